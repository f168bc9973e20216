"""Rewrite fx's flat forward body into nested checkpointed functions (a body transformer).

fx emits one statement per node, each after a ``# COUNTER: i`` marker, and hands the list to the
transformer registered with ``Graph.on_generate_code``.  ``Nester`` regroups the statements: each
region's become a local function called through ``torch.utils.checkpoint.checkpoint``, regions
inside regions included; a node recorded under grad/autocast modes runs inside ``with`` those
modes; every value is deleted after its last use in its own scope.  Names, targets and formatting
stay fx's own, so ``gm.code`` reads like any traced module.

The transformer holds plain data (node names, inputs, modes by index), not graph nodes, so a
module deep-copied with its graph generates the same code.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from torch import fx

__all__ = ["NodeRegion", "Layout", "Nester", "with_modes"]

_COUNTER = re.compile(r"^# COUNTER: (\d+)\n$")


@dataclass(frozen=True)
class NodeRegion:
    """One checkpoint region as graph node indices [first, last], with its nested regions.

    ``label`` is the comment on its function (which stages, or "your checkpoint call"); ``options``
    the extra keyword arguments of its checkpoint call, as source text.
    """

    first: int
    last: int
    children: tuple["NodeRegion", ...] = ()
    label: str = ""
    options: str | None = None  # None: decided from the profiles of its nodes (codegen.region_options)
    name: str = ""
    policy: str = ""  # solvers.base.SAVE_COMPUTE: keep the expensive ops' outputs


@dataclass(frozen=True)
class Layout:
    """What the transformer needs to know of the graph, by node index."""

    names: tuple[str, ...]
    ops: tuple[str, ...]
    inputs: tuple[tuple[int, ...], ...]
    users: tuple[tuple[int, ...], ...]
    modes: tuple[str, ...]  # "" or the context managers to enter around the node, as source

    @classmethod
    def of(cls, graph: fx.Graph, modes_key: str) -> "Layout":
        nodes = list(graph.nodes)
        index = {n: i for i, n in enumerate(nodes)}
        return cls(tuple(n.name for n in nodes), tuple(n.op for n in nodes),
                   tuple(tuple(index[i] for i in n._input_nodes) for n in nodes),
                   tuple(tuple(index[u] for u in n.users) for n in nodes),
                   tuple(", ".join(m.source() for m in n.meta.get(modes_key, ())) for n in nodes))


@dataclass
class Nester:
    """The body transformer: see the module docstring."""

    layout: Layout
    regions: tuple[NodeRegion, ...]
    prologue: tuple[str, ...] = ()  # statements run first (the input check)
    stmt: dict[int, str] = field(default_factory=dict, repr=False)

    def __call__(self, body: list[str]) -> list[str]:
        self.stmt = self._statements(body)
        out: list[str] = []
        self._emit(self._items(0, len(self.layout.names) - 1, self.regions), out, "", keep=set())
        # the prologue reads the inputs: after the placeholders' own statements (``input_1 = input``)
        at = max((k + 1 for k, piece in enumerate(out) if self._is_placeholder(piece)), default=0)
        return out[:at] + [f"{line}\n" for line in self.prologue] + out[at:]

    def _is_placeholder(self, piece: str) -> bool:
        m = _COUNTER.match(piece.split("\n", 1)[0] + "\n")
        return m is not None and self.layout.ops[int(m.group(1))] == "placeholder"

    def _statements(self, body: list[str]) -> dict[int, str]:
        """Node index -> its statement, without fx's own deletions."""
        chunks: dict[int, list[str]] = {}
        current = None
        for piece in body:
            m = _COUNTER.match(piece)
            if m:
                current = int(m.group(1))
                chunks[current] = []
            elif current is None:
                raise RuntimeError("unexpected fx body layout: code before the first node marker")
            else:
                chunks[current].append(piece)
        stmts = {}
        for i, pieces in chunks.items():
            if self.layout.ops[i] == "placeholder":
                stmts[i] = "".join(pieces).rstrip("\n")
                continue
            if not pieces or not pieces[-1].endswith("\n") or not (pieces[-1] == "\n" or pieces[-1].startswith(";")):
                raise RuntimeError(f"unexpected fx body layout at node {self.layout.names[i]}: {pieces!r}")
            stmts[i] = "".join(pieces[:-1])
        return stmts

    @staticmethod
    def _items(first: int, last: int, regions: tuple[NodeRegion, ...]) -> list[Any]:
        """Node indices and regions of one scope, in order."""
        items: list[Any] = []
        i = first
        for r in regions:
            items.extend(range(i, r.first))
            items.append(r)
            i = r.last + 1
        items.extend(range(i, last + 1))
        return items

    # --- names read and written by an item of a scope ---------------------------------------------
    def _reads(self, item: Any) -> list[str]:
        if isinstance(item, NodeRegion):
            return [self.layout.names[i] for i in self._region_inputs(item)]
        return [self.layout.names[i] for i in self.layout.inputs[item]]

    def _writes(self, item: Any) -> list[str]:
        if isinstance(item, NodeRegion):
            return [self.layout.names[i] for i in self._region_outputs(item)]
        return [] if self.layout.ops[item] == "output" else [self.layout.names[item]]

    def _outside_inputs(self, r: NodeRegion, get_attr: bool) -> list[int]:
        found = {j for i in range(r.first, r.last + 1) for j in self.layout.inputs[i]
                 if not r.first <= j <= r.last and (self.layout.ops[j] == "get_attr") == get_attr}
        return sorted(found)

    def _region_inputs(self, r: NodeRegion) -> list[int]:
        return self._outside_inputs(r, get_attr=False)

    def _region_outputs(self, r: NodeRegion) -> list[int]:
        return [i for i in range(r.first, r.last + 1) if any(not r.first <= u <= r.last for u in self.layout.users[i])]

    # --- emission ---------------------------------------------------------------------------------
    def _emit(self, items: list[Any], out: list[str], indent: str, keep: set[str]) -> None:
        last_read: dict[str, int] = {}
        for k, item in enumerate(items):
            for name in self._reads(item):
                last_read[name] = k
        for k, item in enumerate(items):
            dead = [n for n in self._reads(item) if last_read[n] == k and n not in keep]
            dead += [n for n in self._writes(item) if n not in last_read and n not in keep]
            dead = list(dict.fromkeys(dead))
            suffix = f";  {' = '.join(dead + ['None'])}" if dead and item != len(self.layout.names) - 1 else ""
            if isinstance(item, NodeRegion):
                self._emit_region(item, out, indent, suffix)
                continue
            stmt = self.stmt.get(item, "")
            if self.layout.ops[item] == "placeholder":
                if stmt:
                    out.append(f"# COUNTER: {item}\n{indent}{stmt}\n")
                continue
            out.append(f"# COUNTER: {item}\n")
            lines = stmt.split("\n")
            if self.layout.modes[item] and self.layout.ops[item] != "output":
                lines = [f"with {self.layout.modes[item]}:", *("    " + line for line in lines)]
            out.append("\n".join(indent + line if line else line for line in lines) + suffix + "\n")

    def _emit_region(self, r: NodeRegion, out: list[str], indent: str, suffix: str) -> None:
        names = self.layout.names
        inputs = [names[i] for i in self._region_inputs(r)]
        outputs = [names[i] for i in self._region_outputs(r)]
        out.append(f"{indent}def {r.name}({', '.join(inputs)}):  # {r.label}: {names[r.first]} .. {names[r.last]}\n")
        inner = indent + "    "
        for g in self._outside_inputs(r, get_attr=True):
            out.append(f"{inner}{self.stmt[g]}\n")
        self._emit(self._items(r.first, r.last, r.children), out, inner, keep=set(outputs))
        ret = outputs[0] if len(outputs) == 1 else f"({', '.join(outputs)})"
        out.append(f"{inner}return {ret if outputs else 'None'}\n")
        lhs = (outputs[0] if len(outputs) == 1 else ", ".join(outputs)) + " = " if outputs else ""  # (dead code)
        call_args = ", ".join([r.name, *inputs])
        out.append(f"{indent}{lhs}torch.utils.checkpoint.checkpoint({call_args}, use_reentrant=False"
                   f"{r.options or ''}){suffix}\n")


def with_modes(gm: fx.GraphModule, modes_key: str) -> fx.GraphModule:
    """``gm`` with code that runs each node under the grad/autocast modes it was traced under (a
    symbolic trace records them per node; its plain code would run every node outside them).
    The checkpointed modules of codegen/ are built by the same transformer, with regions."""
    import copy

    graph = copy.deepcopy(gm.graph)
    nester = Nester(Layout.of(graph, modes_key), ())
    graph.on_generate_code(lambda _: nester)
    new = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    for attr in ("remat_frontend", "remat_user_regions"):
        if hasattr(gm, attr):
            setattr(new, attr, getattr(gm, attr))
    return new

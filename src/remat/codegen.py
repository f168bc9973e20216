"""Rewrite a traced GraphModule so each planned region runs under ``torch.utils.checkpoint``.

The graph itself is unchanged; only its Python code is: a code generator nests each region's
statements into a local function and calls it through
``torch.utils.checkpoint.checkpoint(fn, *inputs, use_reentrant=False)``, regions inside regions
included, and every value is deleted after its last use in its own scope.  fx emits one statement
per node (between ``# COUNTER`` markers), which we regroup; so names, targets and formatting stay
exactly fx's own and ``gm.code`` reads like any traced module.  Parameters keep their names: the
new module shares the traced module's submodules.

Regions without random ops pass ``preserve_rng_state=False``; those with dropout keep the
default, so recomputation replays the same masks.

BatchNorm recomputation: ``torch.utils.checkpoint`` re-runs a region's forward during backward,
which would update running statistics a second time.  Regions that write module state get a
``context_fn`` whose recompute context freezes it: BatchNorm modules run with momentum 0 and get
their batch counters back; state written by aten ops (torch.export graphs) is protected by a
dispatch mode that runs those ops on copies.
"""
from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.fx.graph import CodeGen, _PyTreeCodeGen

from .chain import Chain
from .runtime import freeze_state
from .profiler.node import META_KEY
from .solvers.base import Region, validate_regions

__all__ = ["generate"]

_COUNTER = re.compile(r"^# COUNTER: (\d+)\n$")


# --- region layout ------------------------------------------------------------------------------
@dataclass(frozen=True)
class _NodeRegion:
    """A region as node indices [first, last], with its name and nested children."""

    name: str
    first: int
    last: int
    children: tuple["_NodeRegion", ...]
    stages: tuple[int, int]


def _node_regions(chain: Chain, regions: Sequence[Region], prefix: str = "ckpt") -> tuple[_NodeRegion, ...]:
    out = []
    for i, r in enumerate(regions):
        name = f"{prefix}_{i}"
        out.append(_NodeRegion(name, chain.stages[r.start].first, chain.stages[r.stop - 1].last,
                               _node_regions(chain, r.children, name), (r.start, r.stop)))
    return tuple(out)


class _NestingMixin:
    """Regroups fx's per-node statements into nested checkpointed functions."""

    _remat_regions: tuple[_NodeRegion, ...] = ()
    _remat_frozen: frozenset[str] = frozenset()  # regions whose nodes write module state
    _remat_random: frozenset[str] = frozenset()  # regions whose nodes draw random numbers
    _remat_freeze_ops: bool = False  # state is written by aten ops, not BatchNorm modules

    def additional_globals(self) -> list[tuple[str, Any]]:
        return [*super().additional_globals(), ("remat_freeze_state", freeze_state)]  # type: ignore[misc]

    def _gen_python_code(self, nodes, root_module, namespace, **kwargs):  # type: ignore[override]
        node_list = list(nodes)
        previous = self._body_transformer  # type: ignore[attr-defined]
        self._body_transformer = lambda body: _Nester(node_list, self._remat_regions, self._remat_frozen,
                                                      self._remat_random, self._remat_freeze_ops).run(body)
        try:
            return super()._gen_python_code(nodes, root_module, namespace, **kwargs)  # type: ignore[misc]
        finally:
            self._body_transformer = previous


class RematCodeGen(_NestingMixin, CodeGen):
    pass


class RematPyTreeCodeGen(_NestingMixin, _PyTreeCodeGen):
    pass


class _Nester:
    """Turns fx's flat body (a list of strings) into nested region functions."""

    def __init__(self, nodes: list[fx.Node], regions: tuple[_NodeRegion, ...], frozen: frozenset[str],
                 random: frozenset[str], freeze_ops: bool) -> None:
        self.nodes = nodes
        self.index = {n: i for i, n in enumerate(nodes)}
        self.regions = regions
        self.frozen = frozen
        self.random = random
        self.freeze = "remat_freeze_state(self, ops=True)" if freeze_ops else "remat_freeze_state(self)"

    def run(self, body: list[str]) -> list[str]:
        self.stmt = self._statements(body)
        items = self._items(0, len(self.nodes) - 1, self.regions)
        out: list[str] = []
        self._emit(items, out, "", keep=set())
        return out

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
            node = self.nodes[i]
            if node.op == "placeholder":
                stmts[i] = "".join(pieces).rstrip("\n")
                continue
            if not pieces or not pieces[-1].endswith("\n") or not (pieces[-1] == "\n" or pieces[-1].startswith(";")):
                raise RuntimeError(f"unexpected fx body layout at node {node.name}: {pieces!r}")
            stmts[i] = "".join(pieces[:-1])
        return stmts

    def _items(self, first: int, last: int, regions: tuple[_NodeRegion, ...]) -> list[Any]:
        """Node indices and regions of one scope, in order."""
        items: list[Any] = []
        i = first
        for r in regions:
            items.extend(range(i, r.first))
            items.append(r)
            i = r.last + 1
        items.extend(range(i, last + 1))
        return items

    # names read and written by an item of a scope
    def _reads(self, item: Any) -> list[str]:
        if isinstance(item, _NodeRegion):
            return [n.name for n in self._region_inputs(item)]
        return [n.name for n in self.nodes[item]._input_nodes]

    def _writes(self, item: Any) -> list[str]:
        if isinstance(item, _NodeRegion):
            return [n.name for n in self._region_outputs(item)]
        node = self.nodes[item]
        return [] if node.op == "output" else [node.name]

    def _inside(self, r: _NodeRegion, node: fx.Node) -> bool:
        return r.first <= self.index[node] <= r.last

    def _region_inputs(self, r: _NodeRegion) -> list[fx.Node]:
        found: dict[fx.Node, None] = {}
        for i in range(r.first, r.last + 1):
            for inp in self.nodes[i]._input_nodes:
                if not self._inside(r, inp) and inp.op != "get_attr":
                    found[inp] = None
        return sorted(found, key=self.index.__getitem__)

    def _region_getattrs(self, r: _NodeRegion) -> list[fx.Node]:
        found: dict[fx.Node, None] = {}
        for i in range(r.first, r.last + 1):
            for inp in self.nodes[i]._input_nodes:
                if not self._inside(r, inp) and inp.op == "get_attr":
                    found[inp] = None
        return sorted(found, key=self.index.__getitem__)

    def _region_outputs(self, r: _NodeRegion) -> list[fx.Node]:
        return [self.nodes[i] for i in range(r.first, r.last + 1)
                if any(not self._inside(r, u) for u in self.nodes[i].users)]

    def _emit(self, items: list[Any], out: list[str], indent: str, keep: set[str]) -> None:
        last_read: dict[str, int] = {}
        for k, item in enumerate(items):
            for name in self._reads(item):
                last_read[name] = k
        for k, item in enumerate(items):
            dead = [n for n in self._reads(item) if last_read[n] == k and n not in keep]
            dead += [n for n in self._writes(item) if n not in last_read and n not in keep]
            dead = list(dict.fromkeys(dead))
            suffix = f";  {' = '.join(dead + ['None'])}" if dead else ""
            if isinstance(item, _NodeRegion):
                self._emit_region(item, out, indent, suffix)
                continue
            stmt = self.stmt.get(item, "")
            if self.nodes[item].op == "placeholder":
                if stmt:
                    out.append(f"# COUNTER: {item}\n{indent}{stmt}\n")
                continue
            out.append(f"# COUNTER: {item}\n")
            lines = stmt.split("\n")
            out.append("\n".join(indent + line if line else line for line in lines) + suffix + "\n")

    def _emit_region(self, r: _NodeRegion, out: list[str], indent: str, suffix: str) -> None:
        inputs = [n.name for n in self._region_inputs(r)]
        outputs = [n.name for n in self._region_outputs(r)]
        first, last = self.nodes[r.first].name, self.nodes[r.last].name
        out.append(f"{indent}def {r.name}({', '.join(inputs)}):  # stages {r.stages[0]}..{r.stages[1] - 1}: "
                   f"{first} .. {last}\n")
        inner = indent + "    "
        for g in self._region_getattrs(r):
            out.append(f"{inner}{self.stmt[self.index[g]]}\n")
        self._emit(self._items(r.first, r.last, r.children), out, inner, keep=set(outputs))
        ret = outputs[0] if len(outputs) == 1 else f"({', '.join(outputs)})"
        out.append(f"{inner}return {ret}\n")
        lhs = outputs[0] if len(outputs) == 1 else ", ".join(outputs)
        ctx = "" if r.name in self.random else ", preserve_rng_state=False"  # no RNG state to stash
        ctx += f", **{self.freeze}" if r.name in self.frozen else ""
        call_args = ", ".join([r.name, *inputs])
        out.append(f"{indent}{lhs} = torch.utils.checkpoint.checkpoint({call_args}, use_reentrant=False{ctx}){suffix}\n")


def _regions_with(flag: str, regions: tuple[_NodeRegion, ...], nodes: list[fx.Node]) -> set[str]:
    """Names of the regions holding a node whose profile has ``flag`` set."""
    names: set[str] = set()
    for r in regions:
        if any(getattr(nodes[i].meta.get(META_KEY), flag, False) for i in range(r.first, r.last + 1)):
            names.add(r.name)
        names |= _regions_with(flag, r.children, nodes)
    return names


def _state_written_by_batchnorm_modules(gm: fx.GraphModule) -> bool:
    """True when every node that writes module state is a call to a BatchNorm module."""
    for node in gm.graph.nodes:
        if getattr(node.meta.get(META_KEY), "mutates_state", False):
            if node.op != "call_module":
                return False
            if not isinstance(gm.get_submodule(node.target), torch.nn.modules.batchnorm._BatchNorm):
                return False
    return True


def _frozen(regions: tuple[_NodeRegion, ...], nodes: list[fx.Node]) -> set[str]:
    return _regions_with("mutates_state", regions, nodes)


def generate(gm: fx.GraphModule, chain: Chain, regions: Sequence[Region]) -> fx.GraphModule:
    """A new GraphModule (sharing ``gm``'s parameters) whose forward checkpoints ``regions``."""
    regions = tuple(regions)
    validate_regions(regions, len(chain.stages))
    graph = copy.deepcopy(gm.graph)
    base = graph._codegen
    cls = RematPyTreeCodeGen if isinstance(base, _PyTreeCodeGen) else RematCodeGen
    codegen = cls.__new__(cls)
    codegen.__dict__.update(copy.copy(base.__dict__))
    node_regions = _node_regions(chain, regions)
    codegen._remat_regions = node_regions
    codegen._remat_frozen = frozenset(_frozen(node_regions, list(graph.nodes)))
    # a region without random ops needs no RNG state: no 5 KB stash per call, no replay
    codegen._remat_random = frozenset(_regions_with("random", node_regions, list(graph.nodes)))
    codegen._remat_freeze_ops = not _state_written_by_batchnorm_modules(gm)
    graph._codegen = codegen
    new = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    for attr in ("_in_spec", "_out_spec", "remat_frontend"):
        if hasattr(gm, attr):
            setattr(new, attr, getattr(gm, attr))
    return new

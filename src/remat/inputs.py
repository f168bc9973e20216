"""What a plan was made for, and the model's own checkpoint calls.

* ``contract``: the planned shape of every graph input and which dimensions may differ (the trace
  keeps them symbolic), with the CPU threads the plan assumes; generated modules check calls
  against it (``runtime.check_inputs``).
* ``user_regions``: the regions the model's own ``torch.utils.checkpoint`` calls cover, recorded by
  the trace (``trace/capture.py``), as node ranges the code generator can checkpoint again.  The
  step with them in place is the user's step today: the baseline a budget fraction refers to.
"""
from __future__ import annotations

import warnings

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from .codegen import NodeRegion, region_options
from .errors import RematWarning
from .profiler.node import META_KEY
from .contract import InputContract, autocast_state
from .trace.capture import REGION_KEY, UserRegion

__all__ = ["contract", "user_regions"]


def _dynamic(node: fx.Node, shape: tuple[int, ...]) -> tuple[bool, ...]:
    """Which dimensions of a graph input may vary: symbolic in torch.export's record of it (and not
    guarded to one value), and every one for symbolic_trace graphs (they hold no sizes)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return (True,) * len(shape)
    # a symbol export guarded to one value (the model filled a buffer slice of that size) is pinned
    return tuple(not (isinstance(d, int) or is_concrete_int(d)) for d in val.shape)


def contract(gm: fx.GraphModule, threads: int) -> InputContract:
    """The inputs ``gm`` was profiled with (its placeholders' profiles), as a contract."""
    names, shapes, dynamic, dtypes = [], [], [], []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        prof = node.meta.get(META_KEY)
        shape = None if prof is None else prof.shape
        names.append(node.name)
        shapes.append(shape)
        dynamic.append(None if shape is None else _dynamic(node, shape))
        dtypes.append(None if shape is None else prof.dtype)
    # torch.export graphs assert each input's dtype; symbolic_trace graphs run any dtype
    return InputContract(tuple(names), tuple(shapes), tuple(dynamic), threads, tuple(dtypes),
                         getattr(gm, "remat_frontend", "") == "export", autocast_state())


def _user_options(gm: fx.GraphModule, span: tuple[int, int], call: UserRegion | None) -> str:
    """The checkpoint options remat would give the region, with the RNG stash as the model asked."""
    options = region_options(gm, NodeRegion(*span))
    preserve = call.preserve_rng_state if call is not None else True
    return options.replace(", preserve_rng_state=False", "") if preserve else (
        options if "preserve_rng_state" in options else ", preserve_rng_state=False" + options)


def user_regions(gm: fx.GraphModule) -> tuple[NodeRegion, ...]:
    """The model's checkpoint calls as nested node regions (see the module docstring).  A call
    whose nodes are not contiguous in the graph cannot be rebuilt: it is left out, with a warning."""
    found: dict[int, UserRegion] = getattr(gm, "remat_user_regions", {}) or {}
    nodes = list(gm.graph.nodes)
    spans: dict[int, list[int]] = {}
    parent: dict[int, int | None] = {}
    for i, node in enumerate(nodes):
        ids = node.meta.get(REGION_KEY, ())
        for depth, rid in enumerate(ids):
            spans.setdefault(rid, []).append(i)
            parent.setdefault(rid, ids[depth - 1] if depth else None)
    # nodes that make no tensor (export's symbolic scalars, such as ``training * 0.1`` for a dropout
    # probability) carry no region mark wherever they sit; a span that holds them still runs as one
    compute = [i for i, n in enumerate(nodes) if n.op not in ("placeholder", "get_attr", "output")
               and getattr(n.meta.get(META_KEY), "tensor_out", True)]
    kept: dict[int, tuple[int, int]] = {}
    for rid, where in spans.items():
        first, last = min(where), max(where)
        inside = set(where)
        if any(first <= i <= last and i not in inside for i in compute):
            warnings.warn(f"remat: the model's checkpoint call #{rid} does not cover a contiguous part of the traced "
                          "graph; it is planned as if it were not there", RematWarning, stacklevel=3)
            continue
        kept[rid] = (first, last)

    def kept_parent(rid: int) -> int | None:
        up = parent[rid]
        while up is not None and up not in kept:
            up = parent[up]
        return up

    def tree(of: int | None) -> tuple[NodeRegion, ...]:
        children = sorted((rid for rid in kept if kept_parent(rid) == of), key=lambda r: kept[r][0])
        return tuple(NodeRegion(kept[r][0], kept[r][1], tree(r), "the model's own checkpoint call",
                                _user_options(gm, kept[r], found.get(r))) for r in children)

    return tree(None)

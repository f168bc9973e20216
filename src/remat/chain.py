"""Linearize a profiled graph into a chain of stages whose boundaries no skip connection crosses.

A cut after node n is allowed when every value defined before n that is used after n is
*common*: a parameter or buffer (get_attr), a placeholder the caller shares (an attention mask),
a value computed only from those (a causal mask, position ids, rotary tables), or a value that
holds no tensor (sizes, ints).  Common values are passed along to the regions that use them.  So only n's own value flows into the next stage,
and a residual block is never split.  A cut is also refused when a later node writes in place into
a storage produced before the cut (BatchNorm followed by an in-place ReLU), because the
checkpoint would then save a tensor that is modified afterwards.

Each ``Stage`` carries the rotor cost model, taken from the node profiles (bytes and FLOPs):
``x`` (its input), ``xbar`` (what it keeps when run with autograd: saved tensors and its output),
``ftmp``/``btmp`` (peak temporaries of its forward and backward).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from torch import fx

from .profiler.node import META_KEY, NodeProfile

__all__ = ["Stage", "Chain", "linearize", "MIN_STAGE_FLOPS"]

# A stage with no arithmetic (a view, a flatten) still costs time to run; the solvers must not
# see recomputing it as free.
MIN_STAGE_FLOPS = 1


@dataclass(frozen=True)
class Stage:
    """A contiguous run of graph nodes [first, last] (indices into graph.nodes)."""

    index: int
    first: int
    last: int
    nodes: tuple[str, ...]
    fwd_flops: int
    bwd_flops: int
    x: int  # bytes of the stage's input activation
    xbar: int  # bytes it keeps with autograd on: saved tensors (input excluded) and its output
    ftmp: int  # peak of its forward with autograd on, beyond what it keeps (xbar)
    btmp: int  # peak of its backward beyond its input gradient and parameter gradients
    y: int  # bytes of its output activation (the next stage's x)
    g: int = 0  # bytes of parameter gradients its backward stores
    fdis: int = 0  # peak of its forward with nothing saved (inside a region), output included


@dataclass
class Chain:
    """The linearized graph: stages in execution order, plus the nodes before and after them."""

    stages: list[Stage]
    node_names: list[str]  # every graph node, in order
    shared_inputs: tuple[str, ...] = ()
    cut_after: list[int] = field(default_factory=list)  # node indices after which a cut is allowed

    def __len__(self) -> int:
        return len(self.stages)

    @property
    def fwd_flops(self) -> int:
        return sum(s.fwd_flops for s in self.stages)

    @property
    def bwd_flops(self) -> int:
        return sum(s.bwd_flops for s in self.stages)

    def describe(self) -> str:
        lines = [f"{'stage':>5} {'nodes':>5}  {'first node':<28}{'last node':<28}{'fwd FLOPs':>12}{'x':>10}{'xbar':>10}"]
        from .units import fmt_bytes, fmt_flops

        for s in self.stages:
            lines.append(f"{s.index:>5} {len(s.nodes):>5}  {s.nodes[0][:27]:<28}{s.nodes[-1][:27]:<28}"
                         f"{fmt_flops(s.fwd_flops):>12}{fmt_bytes(s.x):>10}{fmt_bytes(s.xbar):>10}")
        return "\n".join(lines)


def _profile_of(node: fx.Node) -> NodeProfile:
    prof = node.meta.get(META_KEY)
    if prof is None:
        raise ValueError(f"node {node.name} has no profile: run remat.profile (profile_graph) on the graph first")
    return prof


def _data_dependent(nodes: list[fx.Node], shared: set[str]) -> dict[fx.Node, bool]:
    """Whether a node's value depends on a non-shared input's data (else it is a mask, positions, ...)."""
    dep: dict[fx.Node, bool] = {}
    for node in nodes:
        if node.op == "placeholder":
            dep[node] = not (node.target in shared or node.name in shared)
        elif node.op == "get_attr":
            dep[node] = False
        else:
            dep[node] = any(dep.get(i, True) for i in node._input_nodes)
    return dep


def _common(node: fx.Node, dependent: dict[fx.Node, bool]) -> bool:
    """May cross any cut: state, shared inputs and what derives only from them, or non-tensors."""
    return not dependent[node] or not _profile_of(node).tensor_out


def allowed_cuts(gm: fx.GraphModule, shared_inputs: Iterable[str] = ()) -> list[int]:
    """Indices n (into graph.nodes) such that a stage may end after node n."""
    nodes = list(gm.graph.nodes)
    index = {node: i for i, node in enumerate(nodes)}
    shared = set(shared_inputs)
    dependent = _data_dependent(nodes, shared)
    last_use = [max((index[u] for u in node.users), default=i) for i, node in enumerate(nodes)]
    # in-place writes: a storage produced by p and written by m forbids every cut in [p, m)
    blocked_until = [-1] * len(nodes)
    by_name = {node.name: i for i, node in enumerate(nodes)}
    for i, node in enumerate(nodes):
        prof = node.meta.get(META_KEY)
        for producer in (prof.writes_into if prof else ()):
            p = by_name[producer]
            blocked_until[p] = max(blocked_until[p], i)
    cuts = []
    reach = -1  # furthest use of any non-common value defined before the current node
    block = -1  # furthest in-place write into a storage produced so far
    first_compute = next((i for i, n in enumerate(nodes) if n.op not in ("placeholder", "get_attr")), len(nodes))
    for i, node in enumerate(nodes):
        if node.op == "output":
            break
        block = max(block, blocked_until[i])
        if i >= first_compute and reach <= i and block <= i and not _common(node, dependent):
            cuts.append(i)
        if not _common(node, dependent):
            reach = max(reach, last_use[i])
    return cuts


def _stage(nodes: list[fx.Node], index: int, first: int, last: int, entry: frozenset[int],
           nbytes: dict[int, int]) -> Stage:
    """Costs of nodes[first..last]; ``entry`` holds the storage uids of the stage's input."""
    profs = [_profile_of(n) for n in nodes[first:last + 1]]
    saved = {u for p in profs for u in p.saved_uids if u >= 0 and u not in entry}
    output = {u for u in _profile_of(nodes[last]).value_uids if u >= 0}
    x = sum(nbytes[u] for u in entry if u >= 0)
    y = sum(nbytes[u] for u in output)
    xbar = sum(nbytes[u] for u in saved | output)
    g = sum(p.param_grad for p in profs)
    # Peaks from the profile run's allocator timeline (it keeps everything, like a stage outside
    # any region): the forward above the stage's start, the backward above its first hook.
    ftmp = max(0, max(p.fwd_peak_mark for p in profs) - profs[0].fwd_mark - xbar)
    ran = [p for p in profs if p.bwd_order >= 0]
    if ran:
        base = min(ran, key=lambda p: p.bwd_order).bwd_mark
        btmp = max(0, max(p.bwd_peak_mark for p in ran) - base - x - g)
    else:
        btmp = 0
    # With nothing saved, a node holds the stage-internal values it reads and its own output.
    made = {u for p in profs for u in p.out_uids}
    fdis = max([y] + [sum(nbytes[u] for u in p.in_uids & made) + p.fwd_out + p.fwd_transient for p in profs])
    fwd = max(MIN_STAGE_FLOPS, sum(p.fwd_flops for p in profs))
    bwd = max(MIN_STAGE_FLOPS, sum(p.bwd_flops for p in profs))
    return Stage(index, first, last, tuple(n.name for n in nodes[first:last + 1]), fwd, bwd, x, xbar, ftmp, btmp,
                 y, g, fdis)


def linearize(gm: fx.GraphModule, shared_inputs: Iterable[str] = (), *, min_stage_flops: int = 0) -> Chain:
    """Cut the profiled graph into a chain of stages (see the module docstring)."""
    nodes = list(gm.graph.nodes)
    nbytes: dict[int, int] = {}
    for n in nodes:
        nbytes.update(_profile_of(n).uid_bytes)
    cuts = allowed_cuts(gm, shared_inputs)
    compute = [i for i, n in enumerate(nodes) if n.op not in ("placeholder", "get_attr", "output")]
    if not compute:
        return Chain([], [n.name for n in nodes], tuple(shared_inputs), cuts)
    bounds: list[tuple[int, int]] = []
    start, last_compute = compute[0], compute[-1]
    for c in cuts:
        if c >= last_compute:
            break
        if c >= start:
            bounds.append((start, c))
            start = c + 1
    bounds.append((start, max(last_compute, start)))
    if min_stage_flops:
        bounds = _merge_small(nodes, bounds, min_stage_flops)
    stages = []
    entry = frozenset(u for n in nodes if n.op == "placeholder" for u in _profile_of(n).value_uids)
    for i, (first, last) in enumerate(bounds):
        stages.append(_stage(nodes, i, first, last, entry, nbytes))
        entry = frozenset(_profile_of(nodes[last]).value_uids)
    return Chain(stages, [n.name for n in nodes], tuple(shared_inputs), cuts)


def _merge_small(nodes: list[fx.Node], bounds: list[tuple[int, int]], min_flops: int) -> list[tuple[int, int]]:
    """Fold stages below ``min_flops`` forward FLOPs into their successor (fewer, fuller stages)."""
    merged: list[tuple[int, int]] = []
    pending: int | None = None
    for first, last in bounds:
        start = first if pending is None else pending
        flops = sum(_profile_of(n).fwd_flops for n in nodes[start:last + 1])
        if flops < min_flops and (first, last) != bounds[-1]:
            pending = start
            continue
        merged.append((start, last))
        pending = None
    return merged

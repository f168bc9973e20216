"""Linearize a profiled graph into a chain of stages whose boundaries no skip connection crosses.

A cut after node n is allowed when every value defined before n that is used after n is
*common*: a parameter or buffer (get_attr), a placeholder the caller shares (an attention mask),
a value computed only from those (a causal mask, position ids, rotary tables), or a value that
holds no tensor (sizes, ints).  Common values are passed along to the regions that use them.  So only n's own value flows into the next stage,
and a residual block is never split.  A cut is also refused when a later node writes in place into
a storage produced before the cut (BatchNorm followed by an in-place ReLU), because the
checkpoint would then save a tensor that is modified afterwards.

Each ``Stage`` is a node range; the chain's ``model`` (costs.py) holds every stage's costs, taken
from the node profiles once, here.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import fx

from ..profiler.node import META_KEY, profile_of
from .costs import ChainModel, SkipPart, after_last_save
from .pinned import pinned_readers, shared_unsaved

__all__ = ["Stage", "Chain", "linearize", "MIN_STAGE_FLOPS", "cut_depths", "module_path", "stage_modules"]

# A stage with no arithmetic (a view, a flatten) still costs time to run: counted as 1 FLOP, so
# the solvers never see recomputing it as free (a free stage would be recomputed for any saving).
MIN_STAGE_FLOPS = 1
MIN_STAGE_SECONDS = 1e-7  # the same for time: a tenth of a microsecond


@dataclass(frozen=True)
class Stage:
    """A contiguous run of graph nodes [first, last] (indices into graph.nodes); its costs are row
    ``index`` of the chain's ``model``."""

    index: int
    first: int
    last: int
    nodes: tuple[str, ...]


@dataclass
class Chain:
    """The linearized graph: stages in execution order, their costs, and every node's name."""

    stages: list[Stage]
    model: ChainModel  # one row per stage
    node_names: list[str]  # every graph node, in order
    shared_inputs: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.stages)

    @property
    def fwd_flops(self) -> int:
        return sum(self.model.fwd_flops)

    @property
    def bwd_flops(self) -> int:
        return sum(self.model.bwd_flops)

    def describe(self) -> str:
        lines = [f"{'stage':>5} {'nodes':>5}  {'first node':<28}{'last node':<28}{'fwd FLOPs':>12}{'x':>10}{'xbar':>10}"]
        from ..units import fmt_bytes, fmt_flops

        m = self.model
        for s in self.stages:
            i = s.index
            lines.append(f"{i:>5} {len(s.nodes):>5}  {s.nodes[0][:27]:<28}{s.nodes[-1][:27]:<28}"
                         f"{fmt_flops(m.fwd_flops[i]):>12}{fmt_bytes(m.x[i]):>10}{fmt_bytes(m.xbar[i]):>10}")
        return "\n".join(lines)


def module_path(node: fx.Node) -> str | None:
    """The innermost module a node's op belongs to ("transformer.h.2.attn"), as both tracers record
    it (``nn_module_stack``); "" for the model's own top-level code, None when not recorded."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    paths = [path for path, _ in stack.values() if isinstance(path, str) and not path.startswith("_empty_nn_module")]
    return paths[-1] if paths else ""


def stage_modules(gm: fx.GraphModule, chain: "Chain") -> list[tuple[str, str]]:
    """Per stage, the module paths of its first and last node that has one (for people: regions
    are named by the modules they cover, not by fx's node names)."""
    nodes = list(gm.graph.nodes)
    out = []
    for stage in chain.stages:
        paths = [p for p in (module_path(n) for n in nodes[stage.first:stage.last + 1]) if p is not None]
        out.append((paths[0], paths[-1]) if paths else ("", ""))
    return out


def cut_depths(gm: fx.GraphModule, chain: "Chain") -> list[int]:
    """Per stage, how deep in the module tree the cut before it lies: the number of module-path
    components its last node before the cut and its first node after share (0 for the first stage,
    and between top-level modules)."""
    paths = stage_modules(gm, chain)

    def shared(a: str, b: str) -> int:
        n = 0
        for x, y in zip(a.split(".") if a else [], b.split(".") if b else []):
            if x != y:
                break
            n += 1
        return n

    return [0] + [shared(paths[i - 1][1], paths[i][0]) for i in range(1, len(paths))]


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
    return not dependent[node] or not profile_of(node).tensor_out


@dataclass(frozen=True)
class Cut:
    """A place a stage may end: after node ``index``; ``crossing`` are the values that flow over it."""

    index: int
    crossing: tuple[int, ...]  # node indices of the non-common values defined before and used after
    coarse: bool  # only the node's own value crosses (a boundary no skip connection crosses)


def cuts(gm: fx.GraphModule, shared_inputs: Iterable[str] = (), *, split_blocks: bool = False) -> list[Cut]:
    """Where stages may end.  With ``split_blocks``, also inside residual and dense blocks: cuts
    that skip connections cross, as long as the node's own value flows on; the solvers account for
    the earlier values that cross with it (``ChainModel.skip_parts``)."""
    nodes = list(gm.graph.nodes)
    index = {node: i for i, node in enumerate(nodes)}
    dependent = _data_dependent(nodes, set(shared_inputs))
    last_use = [max((index[u] for u in node.users), default=i) for i, node in enumerate(nodes)]
    # in-place writes: a storage produced by p and written by m forbids every cut in [p, m)
    blocked_until = [-1] * len(nodes)
    by_name = {node.name: i for i, node in enumerate(nodes)}
    for i, node in enumerate(nodes):
        prof = node.meta.get(META_KEY)
        for producer in (prof.writes_into if prof else ()):
            blocked_until[by_name[producer]] = max(blocked_until[by_name[producer]], i)
    found: list[Cut] = []
    active: dict[int, int] = {}  # non-common value -> its last use
    block = -1
    first_compute = next((i for i, n in enumerate(nodes) if n.op not in ("placeholder", "get_attr")), len(nodes))
    for i, node in enumerate(nodes):
        if node.op == "output":
            break
        block = max(block, blocked_until[i])
        if not _common(node, dependent):
            active[i] = last_use[i]
        for j in [j for j, last in active.items() if last <= i]:
            del active[j]
        if i < first_compute or block > i or i not in active:
            continue
        others = [j for j in active if j != i]
        if not others:
            found.append(Cut(i, (i,), True))
        elif split_blocks:
            found.append(Cut(i, tuple(sorted(active)), False))
    return found


def _uids(nodes: list[fx.Node], crossing: Iterable[int]) -> frozenset[int]:
    return frozenset(u for j in crossing for u in profile_of(nodes[j]).value_uids)


def _grads(nodes: list[fx.Node], crossing: Iterable[int]) -> dict[int, int]:
    """Storage uid -> bytes of the gradients the tensors crossing a cut get on it (each tensor its
    own: a view's gradient is the view's size, not its storage's)."""
    found: dict[int, int] = {}
    for u, *_, b in {key for j in crossing for key in profile_of(nodes[j]).grad_tensors}:
        found[u] = found.get(u, 0) + b
    return found


@dataclass(frozen=True)
class _Graph:
    """What every stage's costs read of the whole graph (built once per linearize)."""

    nodes: list[fx.Node]
    nbytes: dict[int, int]  # storage uid -> bytes
    last_saved: dict[int, int]  # storage uid -> the last node index saving it
    kept_uids: frozenset[int]  # outputs of matmul/conv/attention ops
    pinned: frozenset[int]  # storages counted for the whole step (pinned.shared_unsaved)
    resident: frozenset[int]  # the inputs' storages
    readers: dict[int, list[int]]  # storage uid -> the node indices reading it, ascending
    stage_of: dict[int, int]  # node index -> its stage
    maker: dict[int, int]  # storage uid -> the node index that allocated it (absent: an input)
    rng_state: int  # bytes of the RNG state a region stashes when it draws random numbers


def _costs(graph: _Graph, first: int, last: int, entry: frozenset[int], entry_grads: dict[int, int],
           exit_cut: tuple[int, ...]) -> dict[str, object]:
    """Costs of nodes[first..last]: ``entry`` holds the storage uids flowing in (``entry_grads``:
    the bytes of their gradients), ``exit_cut`` the node indices of the values flowing out."""
    nodes, nbytes, last_saved = graph.nodes, graph.nbytes, graph.last_saved
    pinned, stage_of = graph.pinned, graph.stage_of
    profs = [profile_of(n) for n in nodes[first:last + 1]]
    saved = {u for p in profs for u in p.saved_uids if u >= 0 and u not in entry}
    mine = [j for j in exit_cut if j >= first]
    skips = [j for j in exit_cut if j < first]
    output = {u for u in _uids(nodes, mine) if u >= 0}
    # The output stays until the backward only if a later node saves it (a conv's input does, an
    # add's does not); an input nobody saved any more is freed during this stage's forward.  An
    # output that is a view of an input is the producer's to keep: counted here too, GPT-2 6 x 512
    # kept 150 MiB twice (each layer's reshaped matmul outputs) and its predicted step 15 % high.
    kept_output = {u for u in output if last_saved.get(u, -1) > last and u not in entry}
    # (the inputs' storages are resident, the pinned ones counted for the whole step: neither here)
    counted = [u for u in entry if u >= 0 and u not in pinned and u not in graph.resident]
    unkept_input = sum(nbytes[u] for u in counted if last_saved.get(u, -1) < first)
    # values flowing in that no node ever saves: a region starting here is what keeps them alive
    xfree = sum(nbytes[u] for u in counted if u not in last_saved)
    # and by the first stage from here on that reads each: a region holds only those it reads
    by_reader: dict[int, int] = {}
    for u in counted:
        if u not in last_saved:
            later = [r for r in graph.readers.get(u, ()) if r >= first and r in stage_of]
            stage = stage_of[later[0]] if later else stage_of[last]  # (the output only: held)
            by_reader[stage] = by_reader.get(stage, 0) + nbytes[u]
    skip_uids = {u for u in _uids(nodes, skips) if u >= 0} - output - pinned
    # values flowing out that no node ever saves: a region ending here does not hold them (an add
    # reads them and they go); the next stage's forward counts them (its unkept_input), a region
    # starting there holds them (its xfree: the same values, so nothing is counted twice).  Values
    # saved only inside the region are not held either, but a region starting next would hold
    # them with nothing in its xfree saying so: left held (resnet50's block inputs; dropping them
    # and widening xfree to match cost more plans than it won, the double count in between)
    y_free = sum(nbytes[u] for u in output if u not in last_saved)
    # of what a region ending here holds, the outputs of matmul/conv/attention ops: a SAVE_COMPUTE
    # region's cache holds the same tensors, counted once (Llama 7B shape: the sdpa output ending
    # a region, 256 MiB counted twice)
    y_keep = sum(nbytes[u] for u in output if u in graph.kept_uids and u in last_saved and u not in entry)
    # kept outputs only later stages save: freed after their backward, before this stage's (an
    # activation's output saved by the matmul after it, or past a stage that only aliases it)
    ylate = sum(nbytes[u] for u in kept_output if u not in saved)
    x = sum(nbytes[u] for u in entry if u >= 0)
    # the gradients over the input cut: of the values that require grad (no mask, no token ids);
    # and those the backward makes: of the values it reads (one only flowing past keeps the gradient
    # a later stage gave it)
    read = {u for p in profs for u in p.in_uids}
    grad_in = sum(b for u, b in entry_grads.items() if u >= 0)
    grad_new = sum(b for u, b in entry_grads.items() if u >= 0 and u in read)
    y = sum(nbytes[u] for u in output)
    # by the stage that made each storage (an alias made later, a no-op ``to``, does not: counting
    # it made there, a Llama region starting at the alias held the residual its producer keeps)
    made_by = {u: stage_of.get(graph.maker.get(u, -1), -1) for u in skip_uids}
    parts: dict[int, SkipPart] = {}
    for u, stage in made_by.items():
        free = nbytes[u] if u not in last_saved else 0
        keep = nbytes[u] if u in graph.kept_uids and u in last_saved else 0
        parts[stage] = parts.get(stage, SkipPart(stage, 0)).plus(SkipPart(stage, nbytes[u], free, keep))
    xbar = sum(nbytes[u] for u in saved | kept_output)
    g = sum(p.param_grad for p in profs)
    # Peaks from the profile run's allocator timeline (it keeps everything, like a stage outside
    # any region): the forward above the stage's start, the backward above its first hook.
    ftmp = max(0, max(p.fwd_peak_mark for p in profs) - profs[0].fwd_mark - xbar) + unkept_input
    # Negative where the backward allocates less than its input's gradient and its parameter
    # gradients: a stage that only aliases its input (vit's Dropout(p=0.0) returns its input;
    # a view's gradient is a view) passes the gradient it is given on, and one with no backward
    # at all allocates nothing (clamped at 0, vit_b_16's step with no region was modeled 16 MiB
    # high: the GELU output's gradient made again at the dropout after it)
    ran = [p for p in profs if p.bwd_order >= 0]
    if ran:
        base = min(ran, key=lambda p: p.bwd_order).bwd_mark
        btmp = max(p.bwd_peak_mark for p in ran) - base - grad_new - g
    else:
        btmp = -grad_new - g
    # With nothing saved, a node holds the stage-internal values it reads and its own output.
    made = {u for p in profs for u in p.out_uids}
    fdis = max([y] + [sum(nbytes[u] for u in p.in_uids & made) + p.fwd_out + p.fwd_transient for p in profs])
    fwd = max(MIN_STAGE_FLOPS, sum(p.fwd_flops for p in profs))
    bwd = max(MIN_STAGE_FLOPS, sum(p.bwd_flops for p in profs))
    seconds = max(MIN_STAGE_SECONDS, sum(p.fwd_time for p in profs))
    keep_time = min(seconds, sum(p.keep_time for p in profs))
    refused = next((f"{p.name}: {p.keep_refused}" for p in profs if p.keep_refused), "")
    # what follows the stage's last save, not rerun where the stage ends a region's recomputation
    saves, tail_time, tail_flops, tail_keep = after_last_save(
        (p.saves, p.tail_time, p.tail_flops, p.tail_keep) for p in profs)
    if not saves:  # the whole stage, at least MIN_STAGE_SECONDS like its forward
        tail_time, tail_flops = seconds, fwd
    return dict(fwd_flops=fwd, x=x, grad_in=grad_in, grad_new=grad_new, pinned=sum(nbytes[u] for u in pinned & made), y=y, y_free=y_free, y_keep=y_keep,
                skip_parts=tuple(sorted(parts.values())), ylate=ylate, xbar=xbar, ftmp=ftmp, btmp=btmp,
                param_grad=g, fdis=fdis, fwd_time=seconds, keep_bytes=sum(p.keep_bytes for p in profs), keep_time=keep_time,
                xfree=xfree, xfree_parts=tuple(sorted(by_reader.items())),
                rng_state=graph.rng_state if any(p.random for p in profs) else 0, selective_time=sum(p.selective_time for p in profs), keep_refused=refused, bwd_flops=bwd,
                saves=saves, tail_time=min(seconds, tail_time), tail_flops=min(fwd, tail_flops),
                tail_keep=sum(p.keep_bytes for p in profs) if not saves else tail_keep,
                early_stop=not any(p.writes_saved for p in profs), unpacked=any(p.unpacked for p in profs))


def linearize(gm: fx.GraphModule, shared_inputs: Iterable[str] = (), *, split_blocks: bool = False,
              loss_peak: int = 0, loss_grad: int = 0, rng_state: int = 0) -> Chain:
    """Cut the profiled graph into a chain of stages (see the module docstring).

    ``loss_peak``/``loss_grad`` (ModelProfile's): the loss runs after the last stage's forward, with
    its output alive, and its backward before the last stage's; both are charged to the last stage
    (its forward peaks, kept or inside a region, and its backward, which starts with that gradient
    allocated).  A region holding the last stage is then charged the loss again in its
    recomputation, which does not run it: a bound there.  bf16 Llama 4 x 512: the stage model missed the float32 copy of
    the logits (125 MiB of a 408 MiB step) without it.  ``rng_state``: the bytes of the RNG state
    torch's checkpoint stashes for a region that draws random numbers (a CPU step's generator)."""
    nodes = list(gm.graph.nodes)
    nbytes: dict[int, int] = {}
    keeps: set[int] = set()
    for n in nodes:
        nbytes.update(profile_of(n).uid_bytes)
        keeps.update(profile_of(n).keep_uids)
    found = cuts(gm, shared_inputs, split_blocks=split_blocks)
    compute = [i for i, n in enumerate(nodes) if n.op not in ("placeholder", "get_attr", "output")]
    if not compute:
        return Chain([], ChainModel.from_rows([]), [n.name for n in nodes], tuple(shared_inputs))
    bounds: list[tuple[int, int, tuple[int, ...]]] = []
    start, last_compute = compute[0], compute[-1]
    for c in found:
        if c.index >= last_compute:
            break
        if c.index >= start:
            bounds.append((start, c.index, c.crossing))
            start = c.index + 1
    bounds.append((start, max(last_compute, start), (max(last_compute, start),)))
    last_saved: dict[int, int] = {}
    readers: dict[int, list[int]] = {}
    maker: dict[int, int] = {}
    for j, n in enumerate(nodes):
        prof = profile_of(n)
        for u in prof.saved_uids:
            last_saved[u] = j
        for u in prof.in_uids:
            readers.setdefault(u, []).append(j)
        for u in prof.out_uids:
            maker.setdefault(u, j)
    inputs = [j for j, n in enumerate(nodes) if n.op == "placeholder"]
    entry, entry_grads = _uids(nodes, inputs), _grads(nodes, inputs)
    stage_of = {j: i for i, (first, last, _) in enumerate(bounds) for j in range(first, last + 1)}
    pinned = shared_unsaved(nodes, last_saved)
    graph = _Graph(nodes, nbytes, last_saved, frozenset(keeps), pinned, entry, readers,
                   stage_of, maker, rng_state)
    stages: list[Stage] = []
    rows: list[dict[str, object]] = []
    for i, (first, last, crossing) in enumerate(bounds):
        stages.append(Stage(i, first, last, tuple(n.name for n in nodes[first:last + 1])))
        rows.append(_costs(graph, first, last, entry, entry_grads, crossing))
        entry, entry_grads = _uids(nodes, crossing), _grads(nodes, crossing)
    for row, later in zip(rows, pinned_readers(nodes, stage_of, pinned, len(rows))):
        row["pinned_readers"] = later
    end = rows[-1]
    # the output is alive until the loss has read it (xbar leaves it out: nothing saves it)
    end.update(ftmp=max(end["ftmp"], end["y"] + loss_peak), fdis=max(end["fdis"], end["y"] + loss_peak),
               btmp=end["btmp"] + loss_grad)
    return Chain(stages, ChainModel.from_rows(rows), [n.name for n in nodes], tuple(shared_inputs))

"""The one cost record of a chain: per stage, what it keeps, peaks at and costs to run again.

Linearization (stages.py) writes it once from the node profiles; coarsening merges it; every
solver and the simulator (solvers/model.py) read it.  The memory columns use rotor's notation
(Beaumont et al., 2019), in bytes above the resident ones:

* ``x``: the stage's input activation; ``y``: its output;
* ``grad_in``: the gradients over its input cut (``x`` less what requires no grad: a causal mask,
  token ids); ``grad_new``: what of them its backward allocates (of the values it reads: a value
  only flowing past it keeps the gradient a later stage gave it);
  ``y_free``: the part of it that no later node saves (a region ending at the stage does not hold
  it); ``skip_parts``: the values made before the stage that flow over its output cut too (a
  residual block's input), by the stage that made them (``SkipPart``: its ``free`` and ``keep``
  the shares no later node saves and that are kept matmul/conv/attention outputs);
* ``xbar``: what the stage keeps when run with autograd on (saved tensors, and its output when a
  later stage saves it); ``ylate``: the part of it only later stages save, freed after their
  backward (the stage's own backward does not hold it);
* ``ftmp``: the peak of its forward with autograd on, beyond ``xbar``; ``btmp``: the peak of its
  backward beyond its input's gradient and its parameter gradients;
* ``fdis``: the peak of its forward with nothing saved (inside a region), output included.

The other columns keep the names the node profiles use (``fwd_time``, ``keep_bytes``, ...).
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from enum import Enum
from typing import NamedTuple

__all__ = ["ChainModel", "SkipPart", "after_last_save", "RegionPolicy", "FULL", "SAVE_COMPUTE", "POLICIES"]


class RegionPolicy(str, Enum):
    """How a region is recomputed (values are what plans and JSON files carry).

    - ``FULL``: everything inside it runs again in the backward.
    - ``SAVE_COMPUTE``: the outputs of its matmul, convolution and attention ops are kept (torch's
      selective checkpointing), so only the cheap ops between them run again (norms, activations,
      dropout masks, views); never where a later op overwrites a kept output (``keep_refused``).
    """

    FULL = ""
    SAVE_COMPUTE = "save-compute"

    def __str__(self) -> str:
        return self.value


FULL, SAVE_COMPUTE = RegionPolicy.FULL, RegionPolicy.SAVE_COMPUTE
POLICIES = tuple(RegionPolicy)


def after_last_save(parts: Iterable[tuple]) -> tuple:
    """(saves, tail...) of parts run in order, each given as (saves, tail values...) (its tail
    seconds, FLOPs, kept bytes): the whole of the parts after the last one that saves, and that one's
    own tail (all, if none saves)."""
    total: list = []
    for saves, *values in reversed(list(parts)):
        total = [a + b for a, b in zip(total, values)] if total else list(values)
        if saves:
            return (True, *total)
    return (False, *total)


class SkipPart(NamedTuple):
    """Skip values over one cut made by one stage: their bytes, what no later node saves of them,
    and what of them are outputs of matmul/conv/attention ops saved later."""

    producer: int  # the stage that made them (-1: the model's inputs)
    bytes: int
    free: int = 0
    keep: int = 0

    def plus(self, other: "SkipPart") -> "SkipPart":
        """Both parts' values, counted as made by this part's producer."""
        return SkipPart(self.producer, self.bytes + other.bytes, self.free + other.free, self.keep + other.keep)


@dataclass(frozen=True)
class ChainModel:
    """Sizes, FLOPs and times per stage, one tuple per column (bytes, or slots once discretized)."""

    fwd_flops: tuple[int, ...]  # forward FLOPs
    x: tuple[int, ...]  # input bytes (what flows over the cut before it)
    y: tuple[int, ...]  # output bytes
    xbar: tuple[int, ...]  # kept with autograd on (saved tensors and output)
    ftmp: tuple[int, ...]  # forward peak with autograd on, beyond xbar
    btmp: tuple[int, ...]  # backward peak beyond the input gradient and parameter gradients
    param_grad: tuple[int, ...]  # bytes of parameter gradients its backward stores (to the step's end)
    fdis: tuple[int, ...]  # forward peak with nothing saved, output included (above the input)
    fwd_time: tuple[float, ...] = ()  # forward seconds (defaults to the FLOPs: one FLOP, one unit)
    keep_bytes: tuple[int, ...] = ()  # its matmul/conv/attention outputs: what a SAVE_COMPUTE region keeps of it
    keep_time: tuple[float, ...] = ()  # seconds a SAVE_COMPUTE recomputation skips
    xfree: tuple[int, ...] = ()  # input bytes nothing saves: alive through a region starting at the stage
    selective_time: tuple[float, ...] = ()  # seconds a SAVE_COMPUTE region adds to the stage (its dispatch mode)
    # why no SAVE_COMPUTE region may contain the stage ("": one may): a later op writes in place
    # into an output it would keep (NodeProfile.keep_refused of its first such node)
    keep_refused: tuple[str, ...] = ()
    bwd_flops: tuple[int, ...] = ()  # backward FLOPs (reported; the solvers minimize forward time)
    # torch's checkpoint stops a recomputation at the last tensor the region's forward saved (its
    # early stop; profiler/node.py): per stage, whether it saves anything, and the forward time
    # and FLOPs after its last save, which a recomputation ending in it does not run again
    saves: tuple[bool, ...] = ()
    tail_time: tuple[float, ...] = ()
    tail_flops: tuple[int, ...] = ()
    # and the bytes of its kept outputs after its last save: a SAVE_COMPUTE region's recomputation
    # stops before them, torch's cache holds them to the region's backward's end (Llama: the down
    # projection's output, 16 KiB under on a tiny model)
    tail_keep: tuple[int, ...] = ()
    # False where an op writes a tensor it does not return (rrelu's noise): a region over the stage
    # recomputes without early stop (codegen), so to its end
    early_stop: tuple[bool, ...] = ()
    # whether the backward reads a tensor the stage saved: a region none of whose stages is read so
    # (dead code, ops no gradient flows through) is never recomputed
    unpacked: tuple[bool, ...] = ()
    # bytes of its output that no later node saves: freed once read, so a region ending here holds
    # only the rest (an 8-block MLP's plan of small regions was over-predicted by 20 MiB, resnet50's
    # fine plan at every block's peak by 28 MiB; the skip values' share is SkipPart.free)
    y_free: tuple[int, ...] = ()
    # bytes of its xbar that only later stages save (its output, read by their backward only):
    # released after their backward, before its own (an 8-block MLP's GELU output saved by the
    # matmul after it: 10 MiB over-predicted at the GELU's backward; vit_b_16's, saved past a
    # Dropout(p=0.0), 16 MiB while only the next stage's saves counted)
    ylate: tuple[int, ...] = ()
    # gradient bytes over its input cut, and what its backward allocates of them (default: x both).
    # With x, the causal mask of a Llama (b x s x s, 128 MiB at batch 8, seq 4096) had a gradient
    # from its last reader's backward to its first's, and each MLP stage's backward allocated the
    # residual stream's gradient again (Llama 4 x 64: 128 KiB over the step)
    grad_in: tuple[int, ...] = ()
    grad_new: tuple[int, ...] = ()
    # bytes of its output that are outputs of its matmul/conv/attention ops (in keep_bytes) and saved
    # later: a SAVE_COMPUTE region holds them once (the skip values' share is SkipPart.keep)
    y_keep: tuple[int, ...] = ()
    # the values made before the stage that also flow over its output cut (a residual block's
    # input), by the stage that made them, a SkipPart each: a region holds only those it made.
    # Counting every one with the last producer's, each Llama layer's region held the causal mask
    # and rotary tables made before the first layer (7B shape, batch 8: 130 MiB a region, 4 GiB of
    # a 38 GiB plan)
    skip_parts: tuple[tuple["SkipPart", ...], ...] = ()
    # bytes of its outputs that no node saves and repeated blocks all read (a causal mask), and the
    # stages reading them: alive to the last reader's forward, or, once a region over a reader holds
    # them as an input, to that first region's backward (solvers/model.py); the DP counts them for
    # the whole step (pinned.shared_unsaved)
    pinned: tuple[int, ...] = ()
    pinned_readers: tuple[tuple[int, ...], ...] = ()
    # xfree by the first stage at or after this one that reads it, (stage, bytes) pairs (empty: all
    # read here): a region holds past its forward only the inputs it reads (its checkpoint call's
    # arguments).  Counting all, a Llama MLP region held the residual stream only the add after it
    # reads (7B shape: 256 MiB)
    xfree_parts: tuple[tuple[tuple[int, int], ...], ...] = ()
    # bytes of the RNG state torch's checkpoint stashes for a region over the stage when it draws
    # random numbers (a CPU step's generator state, 5 KB a region; 0 otherwise)
    rng_state: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.fwd_flops)
        defaults = {"fwd_time": tuple(float(v) for v in self.fwd_flops),
                    "keep_bytes": (0,) * n, "keep_time": (0.0,) * n, "xfree": (0,) * n, "selective_time": (0.0,) * n,
                    "keep_refused": ("",) * n, "bwd_flops": (0,) * n, "saves": (True,) * n,
                    "tail_time": (0.0,) * n, "tail_flops": (0,) * n, "tail_keep": (0,) * n, "early_stop": (True,) * n,
                    "unpacked": (True,) * n, "y_free": (0,) * n,
                    "ylate": (0,) * n, "y_keep": (0,) * n, "skip_parts": ((),) * n,
                    "pinned": (0,) * n, "pinned_readers": ((),) * n, "rng_state": (0,) * n}
        for name, value in defaults.items():
            if not getattr(self, name):
                object.__setattr__(self, name, value)
        if not self.grad_in:
            object.__setattr__(self, "grad_in", self.x)
        if not self.grad_new:
            object.__setattr__(self, "grad_new", self.grad_in)

    @property
    def keep_safe(self) -> tuple[bool, ...]:
        """Per stage, whether a SAVE_COMPUTE region may contain it."""
        return tuple(not why for why in self.keep_refused)

    def __len__(self) -> int:
        return len(self.fwd_flops)

    def merged(self, groups: Sequence[tuple[int, int]]) -> "ChainModel":
        """The model with each group of stages [a, b) run as one stage.

        A merged stage keeps what its parts keep.  Its forward and backward peaks are those of its
        parts run in sequence under this simulator (exact for a stage kept whole; the backward's may
        be negative: not all of its input and parameter gradients are alive at that peak); run inside
        a region, it peaks at the worst part above the parts before it (their output, a skip value
        they may hold, their keeps: a bound).  Its skip values are those over its last cut.  Bounds
        by sums and maxima instead cost GPT-2 6x512 at seq 256 50 MiB of its floor (591 vs 541 MiB
        modeled for one region per layer, 128 merged of 297 stages).
        """
        where = {i: g for g, (a, b) in enumerate(groups) for i in range(a, b)}

        def remap(parts: tuple[SkipPart, ...]) -> tuple[SkipPart, ...]:
            """Skip parts by merged producer."""
            by: dict[int, SkipPart] = {}
            for p in parts:
                g = where.get(p.producer, -1) if p.producer >= 0 else -1
                by[g] = by.get(g, SkipPart(g, 0)).plus(p)
            return tuple(by.values())

        def merge(a: int, b: int) -> dict[str, int | float]:
            kept = forward_peak = 0
            for i in range(a, b):  # forward with everything kept
                forward_peak = max(forward_peak, kept + self.ftmp[i] + self.xbar[i])
                kept += self.xbar[i]
            held = backward_peak = 0
            for i in reversed(range(a, b)):  # backward from its parts' xbar and its output's gradient
                if i < b - 1:  # (the last part's ylate is the merged stage's: the simulator releases it)
                    held -= self.ylate[i]
                backward_peak = max(backward_peak, held + self.btmp[i] + self.grad_new[i] + self.param_grad[i])
                held += self.grad_in[i] + self.param_grad[i] - self.xbar[i] + self.ylate[i] - self.delta(i)
            param_grad = sum(self.param_grad[a:b])
            fdis = max([self.fdis[a]] + [self.y[i - 1] + self.skip(i - 1) + sum(self.keep_bytes[a:i]) + self.fdis[i]
                                         for i in range(a + 1, b)])
            saves, tail_time, tail_flops, tail_keep = after_last_save(
                zip(self.saves[a:b], self.tail_time[a:b], self.tail_flops[a:b], self.tail_keep[a:b]))
            return dict(
                saves=saves, tail_time=tail_time, tail_flops=tail_flops, tail_keep=tail_keep, early_stop=all(self.early_stop[a:b]),
                unpacked=any(self.unpacked[a:b]), y_free=self.y_free[b - 1],
                y_keep=self.y_keep[b - 1], skip_parts=remap(self.parts(b - 1)),
                pinned=sum(self.pinned[a:b]), xfree_parts=self._merged_xfree(a, where), rng_state=max(self.rng_state[a:b]),
                pinned_readers=tuple(sorted({where[r] for i in range(a, b) for r in self.pinned_readers[i]
                                             if where[r] != where[a]})),
                ylate=self.ylate[b - 1],
                fwd_flops=sum(self.fwd_flops[a:b]), x=self.x[a], grad_in=self.grad_in[a], grad_new=self.grad_new[a], y=self.y[b - 1], xbar=kept, ftmp=max(0, forward_peak - kept),
                btmp=backward_peak - self.grad_new[a] - param_grad, param_grad=param_grad, fdis=fdis,
                fwd_time=sum(self.fwd_time[a:b]), keep_bytes=sum(self.keep_bytes[a:b]), keep_time=sum(self.keep_time[a:b]), xfree=self.xfree[a],
                selective_time=sum(self.selective_time[a:b]),
                keep_refused=next((r for r in self.keep_refused[a:b] if r), ""), bwd_flops=sum(self.bwd_flops[a:b]))

        return ChainModel.from_rows([merge(a, b) for a, b in groups])

    def _merged_xfree(self, a: int, where: dict[int, int]) -> tuple[tuple[int, int], ...]:
        """Stage a's xfree parts with their readers as merged stages."""
        parts = self.xfree_parts[a] if self.xfree_parts else ((a, self.xfree[a]),)
        by: dict[int, int] = {}
        for reader, b in parts:
            by[where[reader]] = by.get(where[reader], 0) + b
        return tuple(sorted(by.items()))

    @classmethod
    def from_rows(cls, rows: Sequence[dict[str, object]]) -> "ChainModel":
        """The model of stages given row by row (a dict of every column's value per stage)."""
        return cls(**{f.name: tuple(r[f.name] for r in rows) for f in fields(cls)})

    def delta(self, i: int) -> int:
        """Bytes of the gradient over stage i's output cut (the next stage's ``grad_in``); none over
        the last (the gradient the loss's backward materializes is in its btmp, chain/stages.py)."""
        return 0 if i == len(self) - 1 else self.grad_in[i + 1]

    def parts(self, i: int) -> tuple["SkipPart", ...]:
        """The skip values over stage i's output cut, by the stage that made them."""
        return self.skip_parts[i]

    def skip(self, i: int) -> int:
        """Bytes of the skip values over stage i's output cut."""
        return sum(p.bytes for p in self.skip_parts[i])

    def made(self, start: int, i: int) -> "SkipPart":
        """The skip values over stage i's output cut made by stages ``start..i``, summed."""
        return functools.reduce(SkipPart.plus, (p for p in self.parts(i) if p.producer >= start), SkipPart(start, 0))

    def out(self, start: int, i: int) -> int:
        """Bytes a region starting at ``start`` holds after stage i, running: its output, and the
        skip values flowing over the same cut that the region made."""
        return self.y[i] + self.made(start, i).bytes

    def kept(self, start: int, i: int) -> int:
        """Bytes a region ``start..i`` holds once its forward is done: ``out`` less what no later
        node saves (the next stage's forward counts that, a region starting there holds it)."""
        return self.out(start, i) - self.y_free[i] - self.made(start, i).free

    def shared(self, start: int, i: int) -> int:
        """Bytes of ``kept(start, i)`` that a SAVE_COMPUTE region starting at ``start`` also keeps
        (outputs of its matmul/conv/attention ops): held once."""
        return self.y_keep[i] + self.made(start, i).keep

    def held_inputs(self, start: int, end: int) -> int:
        """Of ``xfree[start]``, what a region ``start..end`` reads: held from its start to its backward."""
        if not self.xfree_parts:
            return self.xfree[start]
        return sum(b for reader, b in self.xfree_parts[start] if reader <= end)

    def rng_held(self, start: int, end: int) -> int:
        """The RNG state a region ``start..end`` stashes from its start to its backward."""
        return max(self.rng_state[start:end + 1], default=0)

    def region_matrix(self, value: Callable[[int, int], int]) -> list[list[int]]:
        """``m[s][e]``: ``value(s, e)`` for every region ``s..e`` (0 below the diagonal): the DP's tables."""
        n = len(self)
        return [[value(s, e) if e >= s else 0 for e in range(n)] for s in range(n)]

    def cached_tail(self, start: int, end: int) -> int:
        """Kept bytes of a SAVE_COMPUTE region ``start..end`` its recomputation never reaches (torch's
        early stop: after its last save), held by torch's cache to the end of its backward."""
        if not all(self.early_stop[start:end + 1]):
            return 0
        for i in range(end, start - 1, -1):
            if self.saves[i]:
                return self.tail_keep[i] + sum(self.keep_bytes[i + 1:end + 1])
        return sum(self.keep_bytes[start:end + 1])

    def made_matrix(self, field: str) -> list[list[int]]:
        """``m[s][i]``: ``made(s, i)``'s ``field`` for every start and stage (the DP's table)."""
        n = len(self)
        m = [[0] * n for _ in range(n)]
        for i in range(n):
            for p in self.parts(i):
                for s in range(min(p.producer, i) + 1):
                    m[s][i] += getattr(p, field)
        return m

    def recompute_seconds(self, i: int, policy: str) -> float:
        """What recomputing stage i costs in a region with ``policy``."""
        if policy == FULL:
            return self.fwd_time[i]
        return max(0.0, self.fwd_time[i] - self.keep_time[i]) + self.selective_time[i]

    def tail_seconds(self, i: int, policy: str) -> float:
        """What a recomputation ending in stage i (nothing after it saving) does not run of it:
        its ops after its last save (early stop), less the kept ops a SAVE_COMPUTE one skips anyway.
        A SAVE_COMPUTE region's dispatch-mode time (``selective_time``) is never credited: it is paid
        in the forward too, where every op runs (a region of such stages alone is not free)."""
        if policy == FULL:
            return self.tail_time[i]
        ran = max(0.0, self.fwd_time[i] - self.keep_time[i])
        return ran if not self.saves[i] else min(ran, max(0.0, self.tail_time[i] - self.keep_time[i]))

"""The one cost record of a chain: per stage, what it keeps, peaks at and costs to run again.

Linearization (stages.py) writes it once from the node profiles; coarsening merges it; every
solver and the simulator (solvers/model.py) read it.  The memory columns use rotor's notation
(Beaumont et al., 2019), in bytes above the resident ones:

* ``x``: the stage's input activation (its gradient has the same size); ``y``: its output;
  ``y_free``, ``skip_free``: the part of it, and of the skip value over the same cut, that no later
  node saves (a region ending at the stage does not hold them);
* ``xbar``: what the stage keeps when run with autograd on (saved tensors, and its output when a
  later stage saves it); ``ylate``: the part of it only the next stage saves, freed after that
  stage's backward (the stage's own backward does not hold it);
* ``ftmp``: the peak of its forward with autograd on, beyond ``xbar``; ``btmp``: the peak of its
  backward beyond its input's gradient and its parameter gradients;
* ``fdis``: the peak of its forward with nothing saved (inside a region), output included.

The other columns keep the names the node profiles use (``fwd_time``, ``keep_bytes``, ...).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from enum import Enum

__all__ = ["ChainModel", "after_last_save", "RegionPolicy", "FULL", "SAVE_COMPUTE", "POLICIES"]


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


def after_last_save(parts: Iterable[tuple[bool, float, int]]) -> tuple[bool, float, int]:
    """(saves, tail seconds, tail FLOPs) of parts run in order, each given as the same triple: the
    whole of the parts after the last one that saves, and that one's own tail (all, if none saves)."""
    seconds, flops = 0.0, 0
    for saves, part_seconds, part_flops in reversed(list(parts)):
        seconds, flops = seconds + part_seconds, flops + part_flops
        if saves:
            return True, seconds, flops
    return False, seconds, flops


@dataclass(frozen=True)
class ChainModel:
    """Sizes, FLOPs and times per stage, one tuple per column (bytes, or slots once discretized)."""

    fwd_flops: tuple[int, ...]  # forward FLOPs
    x: tuple[int, ...]  # input bytes (gradient of the input has the same size)
    y: tuple[int, ...]  # output bytes
    xbar: tuple[int, ...]  # kept with autograd on (saved tensors and output)
    ftmp: tuple[int, ...]  # forward peak with autograd on, beyond xbar
    btmp: tuple[int, ...]  # backward peak beyond the input gradient and parameter gradients
    param_grad: tuple[int, ...]  # bytes of parameter gradients its backward stores (to the step's end)
    fdis: tuple[int, ...]  # forward peak with nothing saved, output included (above the input)
    skip: tuple[int, ...] = ()  # bytes of a block's input also flowing over the stage's output cut
    skip_from: tuple[int, ...] = ()  # the stage that produced it (-1: none)
    fwd_time: tuple[float, ...] = ()  # forward seconds (defaults to the FLOPs: one FLOP, one unit)
    keep_bytes: tuple[int, ...] = ()  # its matmul/conv/attention outputs: what a SAVE_COMPUTE region keeps of it
    keep_time: tuple[float, ...] = ()  # seconds a SAVE_COMPUTE recomputation skips
    xfree: tuple[int, ...] = ()  # input bytes nothing saves: held by a region starting at the stage
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
    # False where an op writes a tensor it does not return (rrelu's noise): a region over the stage
    # recomputes without early stop (codegen), so to its end
    early_stop: tuple[bool, ...] = ()
    # whether the backward reads a tensor the stage saved: a region none of whose stages is read so
    # (dead code, ops no gradient flows through) is never recomputed
    unpacked: tuple[bool, ...] = ()
    # bytes of its output, and of the skip value over its output cut, that no later node saves:
    # freed once read, so a region ending here holds only the rest (an 8-block MLP's plan of small
    # regions was over-predicted by 20 MiB, resnet50's fine plan at every block's peak by 28 MiB)
    y_free: tuple[int, ...] = ()
    skip_free: tuple[int, ...] = ()
    # bytes of its xbar that only the next stage saves (its output, read by that stage's backward
    # only): released after the next stage's backward, before its own (an 8-block MLP's GELU
    # output saved by the matmul after it: 10 MiB over-predicted at the GELU's backward)
    ylate: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.fwd_flops)
        defaults = {"skip": (0,) * n, "skip_from": (-1,) * n, "fwd_time": tuple(float(v) for v in self.fwd_flops),
                    "keep_bytes": (0,) * n, "keep_time": (0.0,) * n, "xfree": (0,) * n, "selective_time": (0.0,) * n,
                    "keep_refused": ("",) * n, "bwd_flops": (0,) * n, "saves": (True,) * n,
                    "tail_time": (0.0,) * n, "tail_flops": (0,) * n, "early_stop": (True,) * n,
                    "unpacked": (True,) * n, "y_free": (0,) * n,
                    "skip_free": (0,) * n, "ylate": (0,) * n}
        for name, value in defaults.items():
            if not getattr(self, name):
                object.__setattr__(self, name, value)

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

        def merge(a: int, b: int) -> dict[str, int | float]:
            kept = forward_peak = 0
            for i in range(a, b):  # forward with everything kept
                forward_peak = max(forward_peak, kept + self.ftmp[i] + self.xbar[i])
                kept += self.xbar[i]
            held = backward_peak = 0
            for i in reversed(range(a, b)):  # backward from its parts' xbar and its output's gradient
                if i < b - 1:  # (the last part's ylate is the merged stage's: the simulator releases it)
                    held -= self.ylate[i]
                backward_peak = max(backward_peak, held + self.btmp[i] + self.x[i] + self.param_grad[i])
                held += self.x[i] + self.param_grad[i] - self.xbar[i] + self.ylate[i] - self.delta(i)
            param_grad = sum(self.param_grad[a:b])
            fdis = max([self.fdis[a]] + [self.y[i - 1] + self.skip[i - 1] + sum(self.keep_bytes[a:i]) + self.fdis[i]
                                         for i in range(a + 1, b)])
            saves, tail_time, tail_flops = after_last_save(zip(self.saves[a:b], self.tail_time[a:b], self.tail_flops[a:b]))
            return dict(
                saves=saves, tail_time=tail_time, tail_flops=tail_flops, early_stop=all(self.early_stop[a:b]),
                unpacked=any(self.unpacked[a:b]), y_free=self.y_free[b - 1], skip_free=self.skip_free[b - 1],
                ylate=self.ylate[b - 1],
                fwd_flops=sum(self.fwd_flops[a:b]), x=self.x[a], y=self.y[b - 1], xbar=kept, ftmp=max(0, forward_peak - kept),
                btmp=backward_peak - self.x[a] - param_grad, param_grad=param_grad, fdis=fdis, skip=self.skip[b - 1],
                # skip producers are indices of this model: map them to merged stages
                skip_from=where.get(self.skip_from[b - 1], -1) if self.skip_from[b - 1] >= 0 else -1,
                fwd_time=sum(self.fwd_time[a:b]), keep_bytes=sum(self.keep_bytes[a:b]), keep_time=sum(self.keep_time[a:b]), xfree=self.xfree[a],
                selective_time=sum(self.selective_time[a:b]),
                keep_refused=next((r for r in self.keep_refused[a:b] if r), ""), bwd_flops=sum(self.bwd_flops[a:b]))

        return ChainModel.from_rows([merge(a, b) for a, b in groups])

    @classmethod
    def from_rows(cls, rows: Sequence[dict[str, object]]) -> "ChainModel":
        """The model of stages given row by row (a dict of every column's value per stage)."""
        return cls(**{f.name: tuple(r[f.name] for r in rows) for f in fields(cls)})

    def delta(self, i: int) -> int:
        """Bytes of the gradient over stage i's output cut; none over the last (the gradient the
        loss's backward materializes is in the last stage's btmp, chain/stages.py)."""
        return 0 if i == len(self) - 1 else self.y[i] + self.skip[i]

    def out(self, start: int, i: int) -> int:
        """Bytes a region starting at ``start`` holds after stage i, running: its output, and the
        skip value flowing over the same cut if the region produced it."""
        return self.y[i] + (self.skip[i] if self.skip_from[i] >= start else 0)

    def kept(self, start: int, i: int) -> int:
        """Bytes a region ``start..i`` holds once its forward is done: ``out`` less what no later
        node saves (the next stage's forward counts that, a region starting there holds it)."""
        return self.out(start, i) - self.y_free[i] - (self.skip_free[i] if self.skip_from[i] >= start else 0)

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

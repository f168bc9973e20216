"""The stage-level cost model every solver optimizes, as an explicit simulator of nested regions.

This is the execution model of nested non-reentrant ``torch.utils.checkpoint`` on a chain (rotor's
"persistent" model).  Memory is counted above the resident bytes (parameters, buffers, inputs):

* forward of a stage outside any region keeps ``xbar`` (its saved tensors and output);
* a region's forward keeps only its output: inside, each stage holds its input and peaks at
  ``fdis`` above it while it runs, and intermediate outputs are freed at once;
* a region that keeps its expensive ops' outputs (policy SAVE_COMPUTE, torch's selective
  checkpointing) also keeps each stage's ``keep`` bytes through the forward; its recomputation runs
  every stage kept (no regions inside), reusing those outputs, and costs only ``fwd_time - keep_time``;
* a SAVE_COMPUTE region inside a plain one keeps its ``keep`` bytes from the outer forward to the
  end of the outer region's backward (torch's selective checkpoint caches them in the outer forward
  too); rotor's plan space leaves such nestings out, the simulator counts them for any plan;
* the backward of a region first releases its output, re-runs the region's contents with autograd
  (children regions again keep only their outputs), then runs their backward in reverse;
* the backward of a stage needs ``xbar`` and the gradient of its output, produces the gradient of
  its input (``x`` bytes) and its parameter gradients (``g``), which stay to the end of the step.

The cost solvers minimize is recomputation time (``fwd_time``, predicted seconds); FLOPs (``fwd_flops``) are
reported.  The simulator is written independently of the dynamic program in rotor.py; the tests
check the DP's optimum against an exhaustive search evaluated here.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

from ..chain import Chain, Stage
from .base import FULL, Region

__all__ = ["Cost", "ChainModel", "evaluate", "recompute_flops", "recompute_time"]


@dataclass(frozen=True)
class ChainModel:
    """Sizes, FLOPs and times per stage, as plain tuples (bytes, or slots once discretized)."""

    fwd_flops: tuple[int, ...]  # forward FLOPs
    x: tuple[int, ...]  # input bytes (gradient of the input has the same size)
    y: tuple[int, ...]  # output bytes
    xbar: tuple[int, ...]  # kept with autograd on (saved tensors and output)
    ftmp: tuple[int, ...]  # forward peak with autograd on, beyond xbar
    btmp: tuple[int, ...]  # backward peak beyond the input gradient and parameter gradients
    g: tuple[int, ...]  # parameter gradient bytes
    fdis: tuple[int, ...]  # forward peak with nothing saved, output included (above the input)
    skip: tuple[int, ...] = ()  # bytes of a block's input also flowing over the stage's output cut
    skip_from: tuple[int, ...] = ()  # the stage that produced it (-1: none)
    fwd_time: tuple[float, ...] = ()  # forward seconds (defaults to the FLOPs: one FLOP, one unit)
    keep: tuple[int, ...] = ()  # bytes a SAVE_COMPUTE region keeps of this stage
    keep_time: tuple[float, ...] = ()  # seconds a SAVE_COMPUTE recomputation skips
    xfree: tuple[int, ...] = ()  # input bytes nothing saves: held by a region starting at the stage
    # may a SAVE_COMPUTE region contain the stage (False: a later op overwrites an output it would keep)
    keep_safe: tuple[bool, ...] = ()
    selective_time: tuple[float, ...] = ()  # seconds a SAVE_COMPUTE region adds to the stage (its dispatch mode)

    def __post_init__(self) -> None:
        n = len(self.fwd_flops)
        defaults = {"skip": (0,) * n, "skip_from": (-1,) * n, "fwd_time": tuple(float(v) for v in self.fwd_flops),
                    "keep": (0,) * n, "keep_time": (0.0,) * n, "xfree": (0,) * n, "keep_safe": (True,) * n,
                    "selective_time": (0.0,) * n}
        for name, value in defaults.items():
            if not getattr(self, name):
                object.__setattr__(self, name, value)

    @classmethod
    def from_chain(cls, chain: Chain) -> "ChainModel":
        s: list[Stage] = chain.stages
        return cls(tuple(st.fwd_flops for st in s), tuple(st.x for st in s), tuple(st.y for st in s),
                   tuple(st.xbar for st in s), tuple(st.ftmp for st in s), tuple(st.btmp for st in s),
                   tuple(st.g for st in s), tuple(st.fdis for st in s), tuple(st.skip for st in s),
                   tuple(st.skip_from for st in s), tuple(st.fwd_time for st in s), tuple(st.keep for st in s),
                   tuple(st.keep_time for st in s), tuple(st.xfree for st in s),
                   tuple(not st.keep_refused for st in s), tuple(st.selective_time for st in s))

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
                backward_peak = max(backward_peak, held + self.btmp[i] + self.x[i] + self.g[i])
                held += self.x[i] + self.g[i] - self.xbar[i] - self.delta(i)
            g = sum(self.g[a:b])
            fdis = max([self.fdis[a]] + [self.y[i - 1] + self.skip[i - 1] + sum(self.keep[a:i]) + self.fdis[i]
                                         for i in range(a + 1, b)])
            return dict(
                fwd_flops=sum(self.fwd_flops[a:b]), x=self.x[a], y=self.y[b - 1], xbar=kept, ftmp=max(0, forward_peak - kept),
                btmp=backward_peak - self.x[a] - g, g=g, fdis=fdis, skip=self.skip[b - 1],
                # skip producers are indices of this model: map them to merged stages
                skip_from=where.get(self.skip_from[b - 1], -1) if self.skip_from[b - 1] >= 0 else -1,
                fwd_time=sum(self.fwd_time[a:b]), keep=sum(self.keep[a:b]), keep_time=sum(self.keep_time[a:b]), xfree=self.xfree[a],
                keep_safe=all(self.keep_safe[a:b]), selective_time=sum(self.selective_time[a:b]))

        rows = [merge(a, b) for a, b in groups]
        return ChainModel(**{f.name: tuple(r[f.name] for r in rows) for f in fields(self)})

    def delta(self, i: int) -> int:
        """Bytes of the gradient over stage i's output cut (the loss gradient is an expanded scalar)."""
        return 0 if i == len(self) - 1 else self.y[i] + self.skip[i]

    def out(self, start: int, i: int) -> int:
        """Bytes a region starting at ``start`` holds after stage i: its output, and the skip
        value flowing over the same cut if the region produced it."""
        return self.y[i] + (self.skip[i] if self.skip_from[i] >= start else 0)

    def recompute_seconds(self, i: int, policy: str) -> float:
        """What recomputing stage i costs in a region with ``policy``."""
        if policy == FULL:
            return self.fwd_time[i]
        return max(0.0, self.fwd_time[i] - self.keep_time[i]) + self.selective_time[i]


@dataclass(frozen=True)
class Cost:
    peak: int  # highest memory above the resident bytes
    recompute: float  # forward time run again in the backward (seconds, or FLOPs for a FLOP-timed model)


def recompute_flops(model: ChainModel, regions: Sequence[Region]) -> int:
    """FLOPs run again: each stage once more per region that contains it (SAVE_COMPUTE regions
    count their stages' FLOPs too: their cheap ops are recomputed, not their matmuls)."""
    total = 0
    for r in regions:
        total += sum(model.fwd_flops[r.start:r.stop]) + recompute_flops(model, r.children)
    return total


def recompute_time(model: ChainModel, regions: Sequence[Region]) -> float:
    """Seconds run again: each stage once more per region that contains it, minus what a
    SAVE_COMPUTE region keeps."""
    total = 0.0
    for r in regions:
        total += sum(model.recompute_seconds(i, r.policy) for i in range(r.start, r.stop))
        total += recompute_time(model, r.children)
    return total


def _nested_keeps(m: ChainModel, region: Region) -> dict[int, int]:
    """Per stage, the bytes a region's forward keeps: a SAVE_COMPUTE region its expensive outputs;
    a plain one those of the SAVE_COMPUTE regions inside it, which torch's selective checkpoint
    caches during the outer forward too and holds until the outer region's backward."""
    if region.policy != FULL:
        return {i: m.keep[i] for i in range(region.start, region.stop)}
    found: dict[int, int] = {}
    for child in region.children:
        found.update(_nested_keeps(m, child))
    return found


class _Machine:
    def __init__(self, model: ChainModel) -> None:
        self.m = model
        self.cur = 0
        self.peak = 0

    def _touch(self, extra: int = 0) -> None:
        self.peak = max(self.peak, self.cur + extra)

    def items(self, start: int, stop: int, regions: Sequence[Region]) -> list[int | Region]:
        out: list[int | Region] = []
        i = start
        for r in regions:
            out.extend(range(i, r.start))
            out.append(r)
            i = r.stop
        out.extend(range(i, stop))
        return out

    def forward(self, items: list[int | Region]) -> None:
        m = self.m
        for item in items:
            if isinstance(item, Region):
                self.cur += m.xfree[item.start]  # its inputs, held by the checkpoint call until its backward
                held = 0  # what the region holds between its stages (nothing saved)
                nested = _nested_keeps(m, item)
                for i in range(item.start, item.stop):
                    keep = nested.get(i, 0)  # the kept outputs of a SAVE_COMPUTE region (or one inside)
                    # cur already holds the stage's input and the region's earlier keeps; fdis is
                    # the stage's peak above them (chain.py), its keeps counted at once
                    self._touch(keep + m.fdis[i])
                    self.cur += m.out(item.start, i) - held + keep
                    held = m.out(item.start, i)
            else:
                self._touch(m.ftmp[item] + m.xbar[item])
                self.cur += m.xbar[item]

    def backward(self, items: list[int | Region]) -> None:
        m = self.m
        for item in reversed(items):
            if isinstance(item, Region):
                self.cur -= m.out(item.start, item.stop - 1)  # the region's output is recomputed
                kept = sum(_nested_keeps(m, item).values())
                if item.policy != FULL:  # the kept outputs become part of the stages' xbar again
                    self.cur -= kept
                inner = self.items(item.start, item.stop, item.children)
                self.forward(inner)
                self.backward(inner)
                self.cur -= m.xfree[item.start]
                if item.policy == FULL:
                    self.cur -= kept
            else:
                self._touch(m.btmp[item] + m.x[item] + m.g[item])
                self.cur += m.x[item] + m.g[item] - m.xbar[item] - m.delta(item)


def evaluate(model: ChainModel, regions: Sequence[Region]) -> Cost:
    """Peak memory (above resident) and recomputation time of a plan under the model."""
    machine = _Machine(model)
    top = machine.items(0, len(model), regions)
    machine.forward(top)
    machine.backward(top)
    return Cost(machine.peak, recompute_time(model, regions))

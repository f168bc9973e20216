"""The simulator of nested regions on a chain's cost record (chain/costs.py, its notation explained there).

This is the execution model of nested non-reentrant ``torch.utils.checkpoint`` on a chain (rotor's
"persistent" model).  Memory is counted above the resident bytes (parameters, buffers, inputs):

* forward of a stage outside any region keeps ``xbar`` (its saved tensors and output);
* a region's forward keeps only its output, less what no later node saves (``y_free``,
  ``skip_free``: read by what follows and gone): inside, each stage holds its input and peaks at
  ``fdis`` above it while it runs, and intermediate outputs are freed at once;
* a region that keeps its expensive ops' outputs (policy SAVE_COMPUTE, torch's selective
  checkpointing) also keeps each stage's ``keep_bytes`` through the forward; its recomputation runs
  every stage kept (no regions inside), reusing those outputs, and costs only ``fwd_time - keep_time``;
* a SAVE_COMPUTE region inside a plain one keeps its ``keep_bytes`` from the outer forward to the
  end of the outer region's backward (torch's selective checkpoint caches them in the outer forward
  too); rotor's plan space leaves such nestings out, the simulator counts them for any plan;
* the backward of a region first releases its output, re-runs the region's contents with autograd
  (children regions again keep only their outputs), then runs their backward in reverse; the
  re-run stops at the last tensor the region's forward saved (torch's early stop): what follows the
  last save of its last saving stage is not run, nor a child region it ends with (a child saves its
  inputs when called, and runs its own recomputation later) -- the memory counted is the full
  re-run's (a bound); a region whose saved tensors the backward never reads (dead code, no
  gradient through it) is not re-run at all (the DP charges it, a bound);
* the backward of a stage needs ``xbar`` (less ``ylate``, what only the next stage saved, released
  after that stage's backward) and the gradient of its output, produces the gradient of
  its input (``x`` bytes) and its parameter gradients (``param_grad``), which stay to the end of the step.

The cost solvers minimize is recomputation time (``fwd_time``, predicted seconds); FLOPs (``fwd_flops``) are
reported.  The simulator is written independently of the dynamic program in rotor.py; the tests
check the DP's optimum against an exhaustive search evaluated here.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..chain import FULL, ChainModel
from .base import Region

__all__ = ["Cost", "evaluate", "recompute_flops", "recompute_time"]


@dataclass(frozen=True)
class Cost:
    peak: int  # highest memory above the resident bytes
    recompute: float  # forward time run again in the backward (seconds, or FLOPs for a FLOP-timed model)
    recompute_flops: int = 0  # forward FLOPs run again in the backward


def _rerun(model: ChainModel, r: Region, whole: Callable[[int, str], float],
           tail: Callable[[int, str], float]) -> float:
    """What region r's recomputation runs of its own contents, ``whole(i, policy)`` a stage and
    ``tail(i, policy)`` its part after its last save: everything up to the last item that saves
    (a stage that saves, or a child region: it saves its inputs), that item's stage less its tail,
    nothing after it -- unless the region recomputes without early stop (ChainModel.early_stop);
    nothing at all where the backward reads nothing its stages saved (ChainModel.unpacked)."""
    if not any(model.unpacked[r.start:r.stop]):
        return 0.0
    items: list[int | Region] = []
    i = r.start
    for child in r.children:
        items += list(range(i, child.start)) + [child]
        i = child.stop
    items += list(range(i, r.stop))
    early = all(model.early_stop[r.start:r.stop])
    last = next((k for k in reversed(range(len(items)))
                 if isinstance(items[k], Region) or model.saves[items[k]]), -1) if early else len(items)
    total = 0.0
    for k, item in enumerate(items[:last + 1]):
        if isinstance(item, Region):  # its forward, run as a checkpoint: the child's stages once
            total += 0.0 if k == last else sum(whole(j, FULL) for j in range(item.start, item.stop))
        else:
            total += whole(item, r.policy) - (tail(item, r.policy) if k == last else 0.0)
    return total


def recompute_flops(model: ChainModel, regions: Sequence[Region]) -> int:
    """FLOPs run again: each stage once more per region whose recomputation reaches it (SAVE_COMPUTE
    regions count their stages' FLOPs too: their cheap ops are recomputed, not their matmuls)."""
    return sum(round(_rerun(model, r, lambda i, _: model.fwd_flops[i], lambda i, _: model.tail_flops[i]))
               + recompute_flops(model, r.children) for r in regions)


def recompute_time(model: ChainModel, regions: Sequence[Region]) -> float:
    """Seconds run again: each stage once more per region whose recomputation reaches it, minus
    what a SAVE_COMPUTE region keeps."""
    return sum(_rerun(model, r, model.recompute_seconds, model.tail_seconds) + recompute_time(model, r.children)
               for r in regions)


def _nested_keeps(m: ChainModel, region: Region) -> dict[int, int]:
    """Per stage, the bytes a region's forward keeps: a SAVE_COMPUTE region its expensive outputs;
    a plain one those of the SAVE_COMPUTE regions inside it, which torch's selective checkpoint
    caches during the outer forward too and holds until the outer region's backward."""
    if region.policy != FULL:
        return {i: m.keep_bytes[i] for i in range(region.start, region.stop)}
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
                    # the stage's peak above them (chain/costs.py), its keeps counted at once
                    self._touch(keep + m.fdis[i])
                    self.cur += m.out(item.start, i) - held + keep
                    held = m.out(item.start, i)
                self.cur -= held - m.kept(item.start, item.stop - 1)  # read by what follows, never saved
            else:
                self._touch(m.ftmp[item] + m.xbar[item])
                self.cur += m.xbar[item]

    def backward(self, items: list[int | Region]) -> None:
        m = self.m
        for item in reversed(items):
            if isinstance(item, Region):
                self.cur -= m.kept(item.start, item.stop - 1)  # the region's output is recomputed
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
                self.cur -= m.ylate[item]  # what only the next stage saved: its backward is done
                self._touch(m.btmp[item] + m.x[item] + m.param_grad[item])
                self.cur += m.x[item] + m.param_grad[item] - m.xbar[item] + m.ylate[item] - m.delta(item)


def evaluate(model: ChainModel, regions: Sequence[Region]) -> Cost:
    """Peak memory (above resident), recomputation time and FLOPs of a plan under the model."""
    machine = _Machine(model)
    top = machine.items(0, len(model), regions)
    machine.forward(top)
    machine.backward(top)
    return Cost(machine.peak, recompute_time(model, regions), recompute_flops(model, regions))

"""The simulator of nested regions on a chain's cost record (chain/costs.py, its notation explained there).

This is the execution model of nested non-reentrant ``torch.utils.checkpoint`` on a chain (rotor's
"persistent" model).  Memory is counted above the resident bytes (parameters, buffers, inputs):

* forward of a stage outside any region keeps ``xbar`` (its saved tensors and output);
* a region's forward keeps only its output, less what no later node saves (``y_free``,
  ``SkipPart.free``: read by what follows and gone): inside, each stage holds its input and peaks at
  ``fdis`` above it while it runs, and intermediate outputs are freed at once;
* a region that keeps its expensive ops' outputs (policy SAVE_COMPUTE, torch's selective
  checkpointing) also keeps each stage's ``keep_bytes`` through the forward, its output counted once
  where it is one of them (``y_keep``, ``SkipPart.keep``: the same tensor), those its recomputation
  never reaches (after its last save: ``cached_tail``) to the end of its backward; its recomputation runs
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
* the backward of a stage needs ``xbar`` (less ``ylate``, what only later stages saved, released
  after their backward) and the gradient of its output, produces the gradient of
  its input (``grad_in`` bytes, what requires grad; ``grad_new`` of them new, the rest only flowing
  past it) and its parameter gradients (``param_grad``), which stay to the end of the step.

What no node saves and repeated blocks all read (``pinned``: a causal mask each layer's attention
reads) is alive from its stage's forward to its last reader's, or, once a region over a reader
holds it as an input, to the first such region's backward: counted once, however many regions
hold it (rotor's DP counts it for the whole step, a bound).

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
        self.first = True  # the step's forward (not a recomputation)
        # pinned values (chain/costs.py) by the stage that made them: made yet, and the region
        # holding them (the first over a reader)
        self.made: set[int] = set()
        self.holder: dict[int, Region] = {}

    def _made(self, i: int) -> None:
        """After stage i's forward in the step's forward: its pinned values are alive, and those
        it was the last reader of go, unless a region holds them."""
        m = self.m
        if not self.first:
            return
        if m.pinned[i]:
            self.made.add(i)
            self.cur += m.pinned[i]
        for p in list(self.made):
            if p not in self.holder and m.pinned_readers[p] and m.pinned_readers[p][-1] == i:
                self.made.discard(p)
                self.cur -= m.pinned[p]

    def _hold(self, r: Region) -> None:
        """A region starting in the step's forward holds the pinned values it reads, if none does."""
        if self.first:
            for p in self.made:
                if p not in self.holder and any(r.start <= q < r.stop for q in self.m.pinned_readers[p]):
                    self.holder[p] = r

    def _release(self, r: Region) -> None:
        """A region's backward is done: the pinned values it held go."""
        for p in [p for p, h in self.holder.items() if h is r]:
            del self.holder[p]
            self.made.discard(p)
            self.cur -= self.m.pinned[p]

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

    def _kept(self, region: Region) -> int:
        """What a region holds once its forward is done, beyond its inputs and keeps."""
        end = region.stop - 1
        return self.m.kept(region.start, end) - (self.m.shared(region.start, end) if region.policy != FULL else 0)

    def forward(self, items: list[int | Region]) -> None:
        m = self.m
        for item in items:
            if isinstance(item, Region):
                # its inputs nothing saves: alive through its forward, those it reads (the checkpoint
                # call's arguments) until its backward
                self.cur += m.xfree[item.start] + m.rng_held(item.start, item.stop - 1)
                self._hold(item)
                held = 0  # what the region holds between its stages (nothing saved)
                nested = _nested_keeps(m, item)
                once = item.policy != FULL  # its outputs that are kept ones are held once
                for i in range(item.start, item.stop):
                    keep = nested.get(i, 0)  # the kept outputs of a SAVE_COMPUTE region (or one inside)
                    # cur already holds the stage's input and the region's earlier keeps; fdis is
                    # the stage's peak above them (chain/costs.py), its keeps counted at once
                    self._touch(keep - (m.y_keep[i] if once else 0) + m.fdis[i])
                    now = m.out(item.start, i) - (m.shared(item.start, i) if once else 0)
                    self.cur += now - held + keep
                    held = now
                    self._made(i)
                self.cur -= held - self._kept(item)  # read by what follows, never saved
                self.cur -= m.xfree[item.start] - m.held_inputs(item.start, item.stop - 1)
            else:
                self._touch(m.ftmp[item] + m.xbar[item])
                self.cur += m.xbar[item]
                self._made(item)

    def backward(self, items: list[int | Region]) -> None:
        m = self.m
        for item in reversed(items):
            if isinstance(item, Region):
                self.cur -= self._kept(item)  # the region's output is recomputed
                kept = sum(_nested_keeps(m, item).values())
                tail = m.cached_tail(item.start, item.stop - 1) if item.policy != FULL else 0
                if item.policy != FULL:  # the kept outputs become part of the stages' xbar again,
                    self.cur -= kept - tail  # but those after the rerun's early stop stay cached
                inner = self.items(item.start, item.stop, item.children)
                self.forward(inner)
                self.backward(inner)
                self.cur -= m.held_inputs(item.start, item.stop - 1) + m.rng_held(item.start, item.stop - 1) + tail
                self._release(item)
                if item.policy == FULL:
                    self.cur -= kept
            else:
                self.cur -= m.ylate[item]  # what only later stages saved: their backward is done
                self._touch(m.btmp[item] + m.grad_new[item] + m.param_grad[item])
                self.cur += m.grad_in[item] + m.param_grad[item] - m.xbar[item] + m.ylate[item] - m.delta(item)


def evaluate(model: ChainModel, regions: Sequence[Region]) -> Cost:
    """Peak memory (above resident), recomputation time and FLOPs of a plan under the model."""
    machine = _Machine(model)
    top = machine.items(0, len(model), regions)
    machine.forward(top)
    machine.first = False
    machine.backward(top)
    return Cost(machine.peak, recompute_time(model, regions), recompute_flops(model, regions))

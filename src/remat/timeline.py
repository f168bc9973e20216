"""Predicted memory over one training step, op by op: the data behind ``remat plan --timeline``.

``step_timeline`` runs the same fake training step as every prediction (``profiler/dispatch.py``'s
``Simulation``, as ``profiler/step.py``'s ``simulate_step`` does) with the simulated allocator
reporting each change (``StorageTracker.on_change``), and closes one point per aten op: the most
memory allocated while it ran and what stays allocated after it, resident bytes included.  Its
highest point is the predicted peak.  The checkpoint regions of a generated module are recorded as
spans of ops, both where they first run and where the backward recomputes them.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from .profiler.dispatch import ScratchSource, Simulation, Target
from .profiler.memory import storage_bytes
from .step import BWD, run_step
from .units import fmt_bytes

__all__ = ["OpPoint", "Span", "Timeline", "PlanTimeline", "step_timeline", "plan_timeline", "problem_timeline",
           "draw_timeline"]


@dataclass(frozen=True)
class OpPoint:
    """One aten op of the step."""

    index: int
    op: str  # e.g. "aten.addmm.default"
    phase: str  # "fwd" (forward and loss) or "bwd"
    bytes: int  # the most allocated while it ran (its scratch included), resident bytes included
    after: int  # allocated when it returned, resident bytes included


@dataclass(frozen=True)
class Span:
    """One run of a checkpoint region's function: ops ``first..last`` (inclusive)."""

    name: str  # the region's function in the generated code (ckpt_0, ckpt_0_1, ...)
    first: int
    last: int
    phase: str  # "fwd": its first run; "recompute": run again by the backward
    depth: int  # 1 for a top-level region, 2 inside it, ...


@dataclass
class Timeline:
    """Predicted memory of one step, one point per op (see the module docstring)."""

    points: list[OpPoint] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    resident: int = 0  # parameters, buffers and inputs: allocated before the step

    @property
    def peak(self) -> int:
        return max((p.bytes for p in self.points), default=self.resident)

    @property
    def backward_start(self) -> int | None:
        """Index of the first op of the backward (None when there is none)."""
        return next((p.index for p in self.points if p.phase == "bwd"), None)


@dataclass
class PlanTimeline:
    """The step as the model runs it and as the plan runs it, with the plan's budget."""

    original: Timeline
    planned: Timeline
    budget_bytes: int | None
    fixed_bytes: int  # resident + one gradient per parameter: no plan goes below it


class _Recorder:
    def __init__(self, resident: int) -> None:
        self.resident = resident
        self.phase = "fwd"
        self.points: list[OpPoint] = []
        self.spans: list[Span] = []
        self.depth = 0
        self.high: int | None = None  # the most allocated since the last op closed
        self.current = 0

    def change(self, current: int) -> None:
        self.current = current
        self.high = current if self.high is None else max(self.high, current)

    def observe(self, func: Any, args: tuple, kwargs: dict, out: Any, as_is: bool = True,
                kernel: Any = None) -> None:
        if not as_is:  # a composite op about to run as its parts: they close their own points
            return
        high = self.current if self.high is None else max(self.high, self.current)
        self.points.append(OpPoint(len(self.points), str(func), self.phase, self.resident + high,
                                   self.resident + self.current))
        self.high = None


@contextmanager
def _recording_regions(rec: _Recorder) -> Iterator[None]:
    """Mark the ops each checkpoint region runs: generated code calls ``torch.utils.checkpoint.
    checkpoint(fn, ...)`` by attribute, and non-reentrant checkpointing calls ``fn`` again to
    recompute, so wrapping ``fn`` sees both runs."""
    original = torch.utils.checkpoint.checkpoint

    def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        name = getattr(function, "__name__", "region")

        def run(*a: Any, **k: Any) -> Any:
            phase = "recompute" if rec.phase == "bwd" else "fwd"
            first = len(rec.points)
            rec.depth += 1
            try:
                return function(*a, **k)
            finally:
                rec.depth -= 1
                if len(rec.points) > first:
                    rec.spans.append(Span(name, first, len(rec.points) - 1, phase, rec.depth + 1))

        return original(run, *args, **kwargs)

    torch.utils.checkpoint.checkpoint = checkpoint
    try:
        yield
    finally:
        torch.utils.checkpoint.checkpoint = original


def step_timeline(fn: Callable[..., Any], args: tuple, kwargs: dict | None = None, *,
                  target: Target | None = None, scratch: ScratchSource | None = None) -> Timeline:
    """Predicted memory of one training step of ``fn`` (a module: the model, or a generated one),
    op by op, on fake tensors; ``args`` may be on meta.  ``target``/``scratch``: as the planner's."""
    sim = Simulation(fn, tuple(args), kwargs, target, scratch)
    rec = _Recorder(storage_bytes([*sim.state.values(), *sim.inputs], sim.target.allocated))
    sim.tracker.on_change = rec.change
    def on_phase(name: str, loss: Any) -> None:
        if name == BWD:
            rec.phase = BWD

    with sim.running(observer=rec.observe), _recording_regions(rec):
        run_step(lambda: fn(*sim.args, **sim.kwargs), on_phase)
    return Timeline(rec.points, sorted(rec.spans, key=lambda s: (s.first, s.depth)), rec.resident)


def plan_timeline(model: torch.nn.Module, gm: torch.nn.Module, example_inputs: Any,
                  kwargs: dict | None = None) -> PlanTimeline:
    """Timelines of ``model``'s step as it runs and of ``gm``, the module ``remat.checkpoint`` made
    for it, with its plan's budget.  The plan is data: this simulates both modules again (on fake
    tensors, with the plan's device, threads and scratch source), so a plan read from JSON and
    applied with ``remat.apply_plan`` has a timeline too."""
    from .profiled import as_args, state_and_inputs

    plan = getattr(gm, "remat_plan", None)
    if plan is None:
        raise ValueError("gm has no remat_plan: pass the module remat.checkpoint (or apply_plan) returned")
    if plan.info.sharding:
        raise ValueError("timelines draw one unsharded step; this plan is per FSDP2 process")
    args = as_args(example_inputs)
    target = Target(torch.device(plan.info.device), plan.info.threads or 1)
    scratch = None
    if plan.info.scratch == "measured":  # as the planner measured: the same cache answers
        from .profiler.calibrate import calibration_for

        scratch = calibration_for(target, state_and_inputs(model, args, kwargs))
    return _timelines(model, gm, args, kwargs or {}, target, scratch, plan.budget_bytes, plan.info.fixed_bytes or 0)


def problem_timeline(problem: Any, gm: torch.nn.Module, plan: Any) -> PlanTimeline:
    """Timelines of ``problem``'s step as the model runs it and of ``gm`` (its plan): the CLI's,
    which holds the problem already."""
    if problem.shard is not None:
        raise ValueError("timelines draw one unsharded step; this plan is per FSDP2 process")
    return _timelines(problem.baseline, gm, problem.args, problem.kwargs, problem.target, problem.scratch,
                      plan.budget_bytes, problem.fixed)


def _timelines(baseline: torch.nn.Module, gm: torch.nn.Module, args: tuple, kwargs: dict, target: Target,
               scratch: ScratchSource | None, budget: int | None, fixed: int) -> PlanTimeline:
    return PlanTimeline(step_timeline(baseline, args, kwargs, target=target, scratch=scratch),
                        step_timeline(gm, args, kwargs, target=target, scratch=scratch), budget, fixed)


def _x(n: int) -> list[float]:
    return [i / max(1, n - 1) for i in range(n)]


def draw_timeline(data: PlanTimeline, path: str, title: str = "", measured: list[int] | None = None) -> None:
    """Memory over the step (x: the step's progress, each curve scaled to its own length): the
    original and the planned prediction, the planned regions shaded (first runs blue, recomputation
    green), the budget and the fixed bytes, and a measured curve (allocator events) when given."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("timelines need matplotlib: pip install 'remat[plot]'") from e
    mib = 2**20
    fig, ax = plt.subplots(figsize=(11, 4.8))
    planned, original = data.planned, data.original
    xs = _x(len(planned.points))
    shaded: set[str] = set()
    for span in planned.spans:
        color = "tab:blue" if span.phase == "fwd" else "tab:green"
        label = "checkpointed region" if span.phase == "fwd" else "its recomputation"
        ax.axvspan(xs[span.first], xs[span.last], color=color, alpha=0.10 * span.depth, lw=0,
                   label=None if label in shaded else label)
        shaded.add(label)
    ax.plot(_x(len(original.points)), [p.bytes / mib for p in original.points], color="0.55", lw=1.2,
            label=f"original (predicted peak {fmt_bytes(original.peak)})")
    ax.plot(xs, [p.bytes / mib for p in planned.points], color="tab:blue", lw=1.4,
            label=f"planned (predicted peak {fmt_bytes(planned.peak)})")
    if measured:
        ax.plot(_x(len(measured)), [b / mib for b in measured], color="tab:orange", lw=0.9, alpha=0.9,
                label=f"planned, measured (peak {fmt_bytes(max(measured))})")
    if data.budget_bytes is not None:
        ax.axhline(data.budget_bytes / mib, color="tab:red", ls="--", lw=1.2, label=f"budget {fmt_bytes(data.budget_bytes)}")
    ax.axhline(data.fixed_bytes / mib, color="black", ls=":", lw=1, label=f"fixed {fmt_bytes(data.fixed_bytes)}")
    start = planned.backward_start
    if start is not None:
        ax.axvline(xs[start], color="black", lw=0.8, alpha=0.5)
        ax.annotate(" backward", (xs[start], ax.get_ylim()[0]), va="bottom", fontsize=8, alpha=0.7)
    ax.set_xlabel("progress through the training step (ops; each curve scaled to its own length)")
    ax.set_ylabel("allocated memory (MiB)")
    ax.set_title(title or "memory over one training step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

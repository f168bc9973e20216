"""Sweep every solver over budgets from the smallest feasible to unconstrained (the Pareto front)."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import progress as _progress
from ..budget import Budget
from ..errors import InfeasibleBudget
from ..planner import plan_problem, prepare, smallest_budget
from ..solvers.registry import SOLVERS, get_solver
from ..units import fmt_bytes

__all__ = ["Sweep", "SweepRow", "sweep", "sweep_table", "draw_pareto", "pareto_figure"]


@dataclass(frozen=True)
class SweepRow:
    solver: str
    fraction: float | None  # the budget fraction asked for (None for the fixed plans)
    budget_bytes: int | None
    peak_bytes: int | None  # predicted (verified on fake tensors); None when infeasible
    recompute_ratio: float | None
    regions: int
    measured_bytes: int | None = None  # a real step's peak (sweep(measure=True))
    min_bytes: int | None = None  # when infeasible: the smallest budget that solver reaches
    recompute_seconds: float | None = None  # predicted time of the recomputation: what rotor minimizes


@dataclass
class Sweep:
    """Every solver's plans over budgets, and the bounds they lie between."""

    rows: list[SweepRow] = field(default_factory=list)
    fixed_bytes: int = 0  # resident + gradients: no plan goes below it
    unconstrained_bytes: int = 0  # the step without checkpointing

    def __iter__(self) -> Iterator[SweepRow]:  # iterating a Sweep iterates its rows, as sweep() once returned
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def floor_bytes(self) -> int | None:
        """The smallest budget rotor planned under: its verified floor when a budget was below it."""
        found = [r.min_bytes if r.peak_bytes is None else r.budget_bytes for r in self.rows if r.solver == "rotor"]
        found = [b for b in found if b is not None]
        return min(found) if found else None


def _measure(gm: torch.nn.Module, args: tuple, kwargs: dict | None) -> int:
    from ..measure import measure_peak

    return measure_peak(gm, args, kwargs)


def sweep(model: torch.nn.Module, args: tuple, kwargs: dict | None = None, shared_inputs: tuple[str, ...] = (),
          *, points: int = 8, solvers: tuple[str, ...] = tuple(SOLVERS), progress: bool = False,
          measure: bool = False, device: str | torch.device | None = None) -> Sweep:
    """Plan ``model`` with every solver; budgeted solvers at ``points`` fractions from the minimum up to 1.

    ``progress=True`` shows each plan on stderr (``remat.progress``); ``measure=True`` runs each plan
    for one real step and records its measured peak; ``device="cuda"`` plans for a GPU (see
    ``remat.checkpoint``)."""
    was_on = _progress.enabled()
    if progress and not was_on:
        _progress.enable()
    try:
        return _sweep(model, args, kwargs, shared_inputs, points, solvers, measure, device)
    finally:
        if progress and not was_on:
            _progress.disable()


def _sweep(model: torch.nn.Module, args: tuple, kwargs: dict | None, shared_inputs: tuple[str, ...],
           points: int, solvers: tuple[str, ...], measure: bool, device: str | torch.device | None) -> Sweep:
    problem = prepare(model, args, kwargs, shared_inputs, device=device)
    span = max(1, problem.unconstrained - problem.fixed)
    low = max(0.0, (smallest_budget(problem, get_solver("rotor"))[0] - problem.fixed) / span)
    fractions = [min(1.0, low + (1.0 - low) * i / max(points - 1, 1)) for i in range(points)]
    jobs: list[tuple[str, float | None]] = [(s, f) for s in solvers if get_solver(s).budgeted for f in fractions]
    jobs += [(s, None) for s in solvers if not get_solver(s).budgeted]
    result = Sweep(fixed_bytes=problem.fixed, unconstrained_bytes=problem.unconstrained)
    for i, (solver, fraction) in enumerate(jobs):
        budget = None if fraction is None else Budget(fraction=max(fraction, 1e-6))
        label = f"{i + 1}/{len(jobs)} {solver}" + ("" if fraction is None else f" at {fraction:.3f}")
        with _progress.step("sweep", label):
            try:
                gm, plan = plan_problem(problem, solver, budget)
            except InfeasibleBudget as e:
                result.rows.append(SweepRow(solver, fraction, budget.resolve(problem.fixed, problem.unconstrained)
                                            if budget else None, None, None, 0, min_bytes=e.min_bytes))
                continue
            measured = None
            if measure:
                with _progress.step("measure"):
                    measured = _measure(gm, args, kwargs)
            result.rows.append(SweepRow(solver, fraction, plan.budget_bytes, plan.predicted_peak_bytes,
                                        plan.recompute_ratio, len(plan.regions), measured,
                                        recompute_seconds=plan.info.recompute_seconds))
    return result


def sweep_table(rows: "Sweep | list[SweepRow]") -> str:
    rows = rows.rows if isinstance(rows, Sweep) else rows
    measured = any(r.measured_bytes is not None for r in rows)
    lines = [f"{'solver':<13}{'budget':>10}{'budget bytes':>14}{'predicted peak':>16}{'recompute':>11}{'regions':>9}"
             + (f"{'measured peak':>15}" if measured else ""),
             "-" * (88 if measured else 73)]
    for r in rows:
        frac = "-" if r.fraction is None else f"{r.fraction:.3f}"
        budget = "-" if r.budget_bytes is None else fmt_bytes(r.budget_bytes)
        peak = "infeasible" if r.peak_bytes is None else fmt_bytes(r.peak_bytes)
        rec = "-" if r.recompute_ratio is None else f"{r.recompute_ratio:.1%}"
        real = "" if not measured else f"{'-' if r.measured_bytes is None else fmt_bytes(r.measured_bytes):>15}"
        lines.append(f"{r.solver:<13}{frac:>10}{budget:>14}{peak:>16}{rec:>11}{r.regions:>9}{real}")
    return "\n".join(lines)


def draw_pareto(rows: "Sweep | list[SweepRow]", path: str, title: str = "", *, budget_bytes: int | None = None,
                floor_bytes: int | None = None, fixed_bytes: int | None = None) -> None:
    """Draw ``pareto_figure`` to a PNG."""
    import matplotlib.pyplot as plt

    fig = pareto_figure(rows, title, budget_bytes=budget_bytes, floor_bytes=floor_bytes, fixed_bytes=fixed_bytes)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def pareto_figure(rows: "Sweep | list[SweepRow]", title: str = "", *, budget_bytes: int | None = None,
                  floor_bytes: int | None = None, fixed_bytes: int | None = None) -> Any:
    """Peak memory vs recompute FLOPs, one series per solver; measured peaks (hollow markers) where
    the rows have them; vertical lines at the budget, rotor's smallest budget and the fixed bytes (taken from
    a ``Sweep`` unless given).  The "none" point is drawn last and on top, so others never hide it."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("plots need matplotlib: pip install 'remat[plot]'") from e
    if isinstance(rows, Sweep):
        floor_bytes = rows.floor_bytes if floor_bytes is None else floor_bytes
        fixed_bytes = rows.fixed_bytes if fixed_bytes is None else fixed_bytes
        rows = rows.rows
    mib = 2**20
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    styles: dict[str, dict[str, Any]] = {
        "rotor": dict(fmt="o-", color="C0"), "chen-greedy": dict(fmt="s--", color="C1"),
        "chen-sqrtn": dict(fmt="^", color="C2"), "every-stage": dict(fmt="v", color="C4"),
        "none": dict(fmt="*", color="black", ms=16, zorder=10)}
    solvers = sorted(dict.fromkeys(r.solver for r in rows), key=lambda s: s == "none")  # "none" last, on top
    for solver in solvers:
        style = dict(styles.get(solver, dict(fmt="o")))
        fmt = style.pop("fmt")
        style.setdefault("ms", 7)
        pts = sorted((r.peak_bytes / mib, 100 * r.recompute_ratio) for r in rows
                     if r.solver == solver and r.peak_bytes is not None)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], fmt, label=solver, **style)
        real = [(r.measured_bytes / mib, 100 * r.recompute_ratio) for r in rows
                if r.solver == solver and r.measured_bytes is not None and r.recompute_ratio is not None]
        if real:
            ax.plot([p[0] for p in real], [p[1] for p in real], fmt[0], mfc="none", ms=style["ms"] + 4,
                    color=style.get("color"), zorder=style.get("zorder", 2),
                    label=f"{solver}, measured")
    for value, label, line in ((budget_bytes, "budget", "-"), (floor_bytes, "rotor's smallest budget", "--"),
                               (fixed_bytes, "fixed (parameters, inputs, gradients)", ":")):
        if value is not None:
            ax.axvline(value / mib, color="gray", ls=line, lw=1.2, label=f"{label}: {fmt_bytes(value)}")
    ax.set_xlabel("predicted peak memory (MiB)")
    ax.set_ylabel("recompute (% of the step's FLOPs)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig

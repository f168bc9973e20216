"""Sweep every solver over budgets from the smallest feasible to unconstrained (the Pareto front)."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from .budget import Budget
from .errors import InfeasibleBudget
from .planner import model_floor, plan_problem, prepare
from .solvers.registry import SOLVERS, get_solver
from .units import fmt_bytes

__all__ = ["SweepRow", "sweep", "sweep_table", "draw_pareto"]


@dataclass(frozen=True)
class SweepRow:
    solver: str
    fraction: float | None  # the budget fraction asked for (None for the fixed plans)
    budget_bytes: int | None
    peak_bytes: int | None  # predicted (verified on fake tensors); None when infeasible
    recompute_ratio: float | None
    regions: int


def _progress(done: int, total: int, label: str) -> None:
    width = 30
    filled = int(width * done / max(total, 1))
    sys.stderr.write(f"\r[{'#' * filled}{' ' * (width - filled)}] {done}/{total} {label:<28}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def sweep(model: torch.nn.Module, args: tuple, kwargs: dict | None = None, shared_inputs: tuple[str, ...] = (),
          *, points: int = 8, solvers: tuple[str, ...] = tuple(SOLVERS), progress: bool = False) -> list[SweepRow]:
    """Plan ``model`` with every solver; budgeted solvers at ``points`` fractions from the minimum up to 1."""
    problem = prepare(model, args, kwargs, shared_inputs)
    span = max(1, problem.unconstrained - problem.fixed)
    low = max(0.0, (model_floor(problem, get_solver("rotor")) - problem.fixed) / span)
    fractions = [min(1.0, low + (1.0 - low) * i / max(points - 1, 1)) for i in range(points)]
    jobs: list[tuple[str, float | None]] = [(s, f) for s in solvers if get_solver(s).budgeted for f in fractions]
    jobs += [(s, None) for s in solvers if not get_solver(s).budgeted]
    rows = []
    for i, (solver, fraction) in enumerate(jobs):
        if progress:
            _progress(i, len(jobs), f"{solver} {'' if fraction is None else f'{fraction:.3f}'}")
        budget = None if fraction is None else Budget(fraction=max(fraction, 1e-6))
        try:
            _, plan = plan_problem(problem, solver, budget)
            rows.append(SweepRow(solver, fraction, plan.budget_bytes, plan.predicted_peak_bytes,
                                 plan.recompute_ratio, len(plan.regions)))
        except InfeasibleBudget:
            rows.append(SweepRow(solver, fraction, budget.resolve(problem.fixed, problem.unconstrained)
                                 if budget else None, None, None, 0))
    if progress:
        _progress(len(jobs), len(jobs), "done")
    return rows


def sweep_table(rows: list[SweepRow]) -> str:
    lines = [f"{'solver':<13}{'budget':>10}{'budget bytes':>14}{'predicted peak':>16}{'recompute':>11}{'regions':>9}",
             "-" * 73]
    for r in rows:
        frac = "-" if r.fraction is None else f"{r.fraction:.3f}"
        budget = "-" if r.budget_bytes is None else fmt_bytes(r.budget_bytes)
        peak = "infeasible" if r.peak_bytes is None else fmt_bytes(r.peak_bytes)
        rec = "-" if r.recompute_ratio is None else f"{r.recompute_ratio:.1%}"
        lines.append(f"{r.solver:<13}{frac:>10}{budget:>14}{peak:>16}{rec:>11}{r.regions:>9}")
    return "\n".join(lines)


def draw_pareto(rows: list[SweepRow], path: str, title: str = "") -> None:
    """Peak memory vs recompute FLOPs, one series per solver."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("plots need matplotlib: pip install 'remat[plot]'") from e
    fig, ax = plt.subplots(figsize=(7, 4.5))
    markers: dict[str, Any] = {"rotor": "o-", "chen-greedy": "s--", "chen-sqrtn": "^", "every-stage": "v",
                               "none": "*"}
    for solver in dict.fromkeys(r.solver for r in rows):
        pts = sorted((r.peak_bytes / 2**20, 100 * r.recompute_ratio) for r in rows
                     if r.solver == solver and r.peak_bytes is not None)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], markers.get(solver, "o"), label=solver, ms=7)
    ax.set_xlabel("predicted peak memory (MiB)")
    ax.set_ylabel("recompute (% of the step's FLOPs)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

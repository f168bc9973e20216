"""From a model and a budget to a verified checkpointed module.

``prepare`` (problem.py) traces, profiles and linearizes once; ``plan_problem`` solves at the
budget and verifies the generated module on fake tensors (search.py); when nothing fits,
``InfeasibleBudget`` names the smallest budget at which a verified plan exists (errors.py).
"""
from __future__ import annotations

import time
import warnings
from dataclasses import replace

from torch import fx

from ..budget import Budget
from ..chain import stage_modules
from ..errors import RematWarning
from ..solvers.base import Plan
from ..solvers.info import PlanInfo
from ..solvers.model import recompute_flops, recompute_time
from ..solvers.registry import Solver, SolveSettings, get_solver
from .errors import fixed_plan_too_big, infeasible
from .problem import Granularity, Problem, coarsen, prepare
from .search import Candidate, NoFit, SelectiveReplay, apply_regions, find_plan, smallest_budget, solve_regions

__all__ = ["Candidate", "Granularity", "Problem", "apply_regions", "coarsen", "plan_problem",
           "prepare", "smallest_budget"]


def _count(regions) -> int:
    return sum(1 + _count(r.children) for r in regions)


def plan_problem(problem: Problem, solver_name: str, budget: Budget | None,
                 settings: SolveSettings = SolveSettings(), verify: bool = True) -> tuple[fx.GraphModule, Plan]:
    """Solve, generate and verify; returns the module and its Plan (or raises InfeasibleBudget).

    When nothing passes at the budget, the smallest budget that does is found (the least-memory
    plan, verified once); it is reported in InfeasibleBudget, or, should that plan fit the budget
    after all, it is returned.  ``budget.minimum`` plans at that smallest budget.
    """
    solver = get_solver(solver_name)
    start = time.perf_counter()
    try:
        found, budget_bytes = _search(problem, solver, budget, settings, verify)
    except SelectiveReplay as e:
        warnings.warn(f"a region keeping its matmul/conv/attention outputs cannot be replayed by torch's "
                      f"selective checkpoint ({e}); planned without such regions", RematWarning, stacklevel=3)
        found, budget_bytes = _search(problem, solver, budget, replace(settings, selective=False), verify)
    return _result(problem, solver, found, budget_bytes, settings, start)


def _search(problem: Problem, solver: Solver, budget: Budget | None, settings: SolveSettings,
            verify: bool) -> tuple[Candidate, int | None]:
    """The verified candidate at the budget, and the budget in bytes (see plan_problem)."""
    if budget is not None and budget.minimum and not solver.budgeted:
        raise ValueError(f"budget='min' needs a solver that plans under a budget, not {solver.name!r}")
    least = smallest_budget(problem, solver, settings, verify) if budget is not None and budget.minimum else None
    budget_bytes = least[0] if least else None if budget is None else budget.resolve(problem.fixed, problem.unconstrained)
    if budget_bytes is None and solver.budgeted:
        raise ValueError(f"solver {solver.name!r} needs a budget")
    # First without rotor's 4x-slot retry near the floor (16x one table): when nothing fits, the
    # floor (one table, one verification) says whether the budget is feasible at all, and only then
    # is the finer table worth its time.
    first = replace(settings, retry=False)
    # Under the bound no checkpointing goes below (a true lower bound of every plan's peak) nothing
    # is solved at the budget: the floor alone says how far it is (one table instead of two).
    hopeless = (solver.budgeted and budget_bytes is not None and problem.bound is not None
                and budget_bytes < problem.bound.bytes)
    try:
        if hopeless and not least:
            raise NoFit(None)
        found = least[1] if least else find_plan(problem, solver, budget_bytes, first, verify)
    except NoFit as e:
        if not solver.budgeted:
            raise fixed_plan_too_big(problem, budget_bytes or 0, solver.name, e.best_peak) from None
        need, found = smallest_budget(problem, solver, settings, verify)
        if need > budget_bytes:
            raise infeasible(problem, budget_bytes, solver.name, need) from None
        if settings.retry:  # feasible: a finer table may find a plan recomputing less than the floor's
            try:
                found = find_plan(problem, solver, budget_bytes, settings, verify)
            except NoFit:
                pass
    return found, budget_bytes


def _best_seconds(problem: Problem, solver: Solver, found: Candidate, budget_bytes: int | None,
                  settings: SolveSettings) -> float | None:
    """The least recomputation time any plan in remat's space has at the budget (the plan's peak
    when there is none), by rotor's optimum on the stage model: the plan's own when an optimal
    solver found it at the first attempt, else one more solve."""
    if not found.regions:
        return 0.0
    if solver.optimal and found.attempts == 1:
        return recompute_time(found.level.exact, found.regions)
    budget = budget_bytes if budget_bytes is not None else problem.margin.budget_for(found.peak)
    limit = budget - problem.resident  # as find_plan's first solve
    best = solve_regions(problem, get_solver("rotor"), limit, replace(settings, retry=False))
    return None if best is None else recompute_time(best[0].exact, best[1])


def _result(problem: Problem, solver: Solver, found: Candidate, budget_bytes: int | None,
            settings: SolveSettings, start: float) -> tuple[fx.GraphModule, Plan]:
    """The generated module with its Plan attached."""
    model = found.level.exact
    plan = Plan(
        solver=solver.name, budget_bytes=budget_bytes, predicted_peak_bytes=found.peak,
        recompute_flops=recompute_flops(model, found.regions),
        stages=[list(s.nodes) for s in found.level.chain.stages], regions=found.regions,
        step_flops=problem.profile.fwd_flops + problem.profile.bwd_flops,
        info=PlanInfo(
            unconstrained_peak_bytes=problem.unconstrained, fixed_bytes=problem.fixed, resident_bytes=problem.resident,
            margin_bytes=problem.margin.allowance(found.peak) if found.regions else 0,
            bound_bytes=problem.bound.bytes if problem.bound else None,
            bound_reason=problem.bound.reason if problem.bound else "",
            granularity=found.level.name,
            stage_modules=[list(pair) for pair in stage_modules(problem.gm, found.level.chain)],
            keep_refused=[[i, why] for i, why in enumerate(found.level.exact.keep_refused) if why],
            recompute_seconds=recompute_time(model, found.regions),
            best_recompute_seconds=_best_seconds(problem, solver, found, budget_bytes, settings),
            step_seconds=sum(n.fwd_time + n.bwd_time for n in problem.profile.nodes),
            solve_seconds=round(time.perf_counter() - start, 3), attempts=found.attempts, slots=settings.slots,
            frontend=problem.profile.frontend,
            inputs={n: list(sh) for n, sh in zip(problem.gm.remat_contract.names, problem.gm.remat_contract.shapes)
                    if sh is not None},
            user_checkpoints=_count(problem.user_regions),
            user_checkpoints_kept=bool(problem.user_regions) and found.module is problem.baseline,
            world_size=problem.shard.world_size if problem.shard else 1,
            sharding="fsdp" if problem.shard else "",
            **problem.scratch_info()),
    )
    found.module.remat_plan = plan
    return found.module, plan

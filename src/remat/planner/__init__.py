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
from ..solvers.registry import Solver, SolveSettings, get_solver
from .problem import Granularity, Problem, coarsen, prepare
from .search import Candidate, Found, SelectiveReplay, apply_regions, smallest_budget, verified_plan

__all__ = ["Candidate", "Granularity", "Problem", "apply_regions", "coarsen", "plan_problem",
           "prepare", "smallest_budget"]


def _count(regions) -> int:
    return sum(1 + _count(r.children) for r in regions)


def plan_problem(problem: Problem, solver_name: str, budget: Budget | None,
                 settings: SolveSettings = SolveSettings(), verify: bool = True) -> tuple[fx.GraphModule, Plan]:
    """Solve, generate and verify (search.py); returns the module and its Plan (or raises
    InfeasibleBudget).  A plan torch's selective checkpoint cannot replay is planned again without
    keeping regions, with a warning."""
    solver = get_solver(solver_name)
    start = time.perf_counter()
    try:
        found = verified_plan(problem, solver, budget, settings, verify)
    except SelectiveReplay as e:
        warnings.warn(f"a region keeping its matmul/conv/attention outputs cannot be replayed by torch's "
                      f"selective checkpoint ({e}); planned without such regions", RematWarning, stacklevel=3)
        found = verified_plan(problem, solver, budget, replace(settings, selective=False), verify)
    return _result(problem, solver, found, settings, start)


def _result(problem: Problem, solver: Solver, searched: Found, settings: SolveSettings,
            start: float) -> tuple[fx.GraphModule, Plan]:
    """The generated module with its Plan attached."""
    found = searched.candidate
    plan = Plan(
        solver=solver.name, budget_bytes=searched.budget_bytes, predicted_peak_bytes=found.peak,
        recompute_flops=found.cost.recompute_flops,
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
            recompute_seconds=found.cost.recompute,
            best_recompute_seconds=searched.best_recompute_seconds,
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

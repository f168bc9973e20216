"""Find a verified plan at one budget, and the smallest budget at which one exists.

The solvers work on the stage model; the generated module is then simulated on fake tensors.  If
that prediction is over the budget, the solver's limit is tightened by the overshoot and it solves
again (``find_plan``).  ``smallest_budget`` walks up from the solver's own model floor to the first
budget that passes, then bisects down.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from torch import fx

from .. import progress
from ..codegen import generate
from ..solvers.base import Region
from ..solvers.model import ChainModel, evaluate, recompute_time
from ..solvers.registry import Solver, SolveSettings
from .problem import Granularity, Problem

__all__ = ["Candidate", "NoFit", "VERIFY_MARGIN", "apply_regions", "smallest_budget",
           "solve_regions", "model_floor", "find_plan"]

# Attempts of solve -> generate -> verify at one budget; each tightens the limit by at least the
# stage model's error on the failed plan, and in practice the second attempt passes.
MAX_ATTEMPTS = 6
# The fake-tensor prediction matches real CPU peaks within ~0.1 % (benchmarks/memory.py, the tests);
# a verified plan must leave this much of the budget unused so a real run stays inside it.
VERIFY_MARGIN = 0.0025
# Each retry also tightens the limit by this share of it, so a plan the stage model misjudges is
# not found again.
TIGHTEN = 0.005
# The floor search: steps up from the model's floor, then as many bisection steps down; it stops
# once the gap is within FLOOR_TOLERANCE of the budget (or FLOOR_MIN_GAP bytes).
FLOOR_ROUNDS = 4
FLOOR_TOLERANCE = 0.001
FLOOR_MIN_GAP = 1024


@dataclass
class Candidate:
    """A verified plan: its granularity, regions, generated module and predicted peak."""

    level: Granularity
    regions: tuple[Region, ...]
    module: fx.GraphModule
    peak: int  # predicted peak of one training step of ``module``
    attempts: int  # solve/verify rounds it took


class NoFit(Exception):
    """No plan passed verification at a budget; ``best_peak`` is the lowest prediction seen."""

    def __init__(self, best_peak: int | None) -> None:
        super().__init__(best_peak)
        self.best_peak = best_peak


def _expand(regions: tuple[Region, ...], groups: list[tuple[int, int]]) -> tuple[Region, ...]:
    """Regions over coarse stages -> regions over the chain's stages."""
    return tuple(Region(groups[r.start][0], groups[r.stop - 1][1], _expand(r.children, groups)) for r in regions)


def apply_regions(problem: Problem, regions: tuple[Region, ...], level: str = "blocks") -> fx.GraphModule:
    """The checkpointed module for ``regions`` over the stages of ``level``; with none, the step as
    the model runs it (its own checkpoint calls kept)."""
    return generate(problem.gm, problem.levels[level].chain, regions) if regions else problem.baseline


def solve_regions(problem: Problem, solver: Solver, limit: int,
                  settings: SolveSettings = SolveSettings()) -> tuple[Granularity, tuple[Region, ...]] | None:
    """The plan whose modeled peak (above resident) fits ``limit`` with the least recomputation.

    Budgeted solvers solve both granularities and keep the better plan (the fine chain can also
    checkpoint inside a residual block); the fixed plans use the block chain.
    """
    levels = [problem.levels["blocks"]]
    if solver.budgeted and "fine" in problem.levels:
        levels.append(problem.levels["fine"])
    best: tuple[float, Granularity, tuple[Region, ...]] | None = None
    for level in levels:
        # the 4x-slot retry near the floor only while no level has a plan (it costs 16x)
        tried = SolveSettings(settings.slots, settings.retry and best is None, settings.selective)
        regions = solver.regions(level.model, limit, tried) if len(level.model) else ()
        if regions is None:
            continue
        regions = _expand(regions, level.groups)
        work = recompute_time(ChainModel.from_chain(level.chain), regions)
        if best is None or work < best[0]:
            best = (work, level, regions)
    return None if best is None else (best[1], best[2])


def model_floor(problem: Problem, solver: Solver, settings: SolveSettings = SolveSettings()) -> int:
    """The smallest absolute budget ``solver``'s least-memory plan fits under the stage model
    (rotor: the DP optimum; chen-greedy: its best candidate), before any verification."""
    need = []
    for level in problem.levels.values():
        need.append(solver.floor(level.model, settings) if solver.floor else evaluate(level.model, ()).peak)
    return problem.resident + min(need)


def find_plan(problem: Problem, solver: Solver, budget_bytes: int | None,
           settings: SolveSettings = SolveSettings(), verify: bool = True) -> Candidate:
    """Solve, generate and verify at one budget, tightening the solver's limit by each overshoot.

    Raises NoFit when no plan passes within MAX_ATTEMPTS.
    """
    limit = (budget_bytes - problem.resident) if budget_bytes is not None else evaluate(problem.model, ()).peak
    blocks = problem.levels["blocks"]
    # the step fits as it is: a budgeted solver has nothing to recompute
    if solver.budgeted and budget_bytes is not None and problem.unconstrained <= budget_bytes:
        return Candidate(blocks, (), problem.baseline, problem.unconstrained, 1)
    best: int | None = None
    for attempts in range(1, MAX_ATTEMPTS + 1):
        with progress.step("solve"):
            found = solve_regions(problem, solver, limit, settings)
        if found is None:
            raise NoFit(best)
        level, regions = found
        gm = apply_regions(problem, regions, level.name)
        if not regions:
            peak = problem.unconstrained  # the model's own step
        elif verify:
            with progress.step("verify"):
                peak = problem.predict(gm)
        else:
            peak = problem.resident + evaluate(ChainModel.from_chain(level.chain), regions).peak
        margin = VERIFY_MARGIN if regions else 0.0
        if budget_bytes is None or peak <= budget_bytes * (1 - margin):
            return Candidate(level, regions, gm, peak, attempts)
        best = peak if best is None else min(best, peak)
        if not solver.budgeted:
            break
        # tighten by the overshoot plus TIGHTEN, and at least by the stage model's error on this plan
        target = int(budget_bytes * (1 - VERIFY_MARGIN))
        modeled = problem.resident + evaluate(ChainModel.from_chain(level.chain), regions).peak
        limit = min(limit - (peak - target) - max(1, int(limit * TIGHTEN)),
                    target - problem.resident - max(0, peak - modeled))
    raise NoFit(best)


def smallest_budget(problem: Problem, solver: Solver, settings: SolveSettings = SolveSettings(),
                    verify: bool = True) -> tuple[int, Candidate]:
    """The smallest budget (bytes) at which ``solver`` returns a verified plan, and that plan.

    Searched upward from the stage model's floor: each failed budget is raised to what its best
    plan was predicted to need (plus the verification margin); the unconstrained peak, where no
    checkpointing is needed, always fits. A few bisection steps then narrow the gap between the
    last budget that failed and the first that passed.
    """
    low, candidate = 0, min(model_floor(problem, solver, settings), problem.unconstrained)
    found = None
    for _ in range(FLOOR_ROUNDS):
        if candidate >= problem.unconstrained:
            break
        try:
            found = find_plan(problem, solver, candidate, settings, verify)
            break
        except NoFit as e:
            low = candidate
            need = math.ceil(e.best_peak / (1 - VERIFY_MARGIN)) + 1 if e.best_peak is not None else 0
            candidate = max(need, candidate + max(1, int(candidate * TIGHTEN)))
    if found is None:
        candidate = problem.unconstrained
        found = find_plan(problem, solver, candidate, settings, verify)
    # the stage model's floor is rounded up to its memory slots: the true floor may lie below it
    low = low or max(problem.fixed, candidate - 2 * max(1, problem.unconstrained - problem.resident) // settings.slots)
    for _ in range(FLOOR_ROUNDS):
        middle = (low + candidate) // 2
        if candidate - low <= max(FLOOR_MIN_GAP, int(candidate * FLOOR_TOLERANCE)):
            break
        try:
            found, candidate = find_plan(problem, solver, middle, settings, verify), middle
        except NoFit:
            low = middle
    return candidate, found

"""Find a verified plan at one budget, and the smallest budget at which one exists.

The solvers work on the stage model; the generated module is then simulated on fake tensors and
verified: its predicted peak plus the problem's margin (``remat/margin.py``, from measured errors)
must fit the budget.  If not, the solver's limit is tightened by the overshoot and it solves again
(``find_plan``); where a plan fits with the stage model over-predicting it, the limit is raised
instead, a few rounds, while the verified plan still fits (``_loosen``).  ``smallest_budget`` is
direct: the solver's least-memory plan on each granularity, verified once; its verified need is
the floor.  ``verified_plan`` is the planner's one entry: the plan at a budget (or the floor when
nothing fits), with the best possible recomputation at that budget.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from torch import fx

from .. import progress
from ..budget import Budget
from ..codegen import generate
from ..errors import KeptOutputOverwritten
from ..solvers.base import SAVE_COMPUTE, Region
from ..solvers.model import Cost, evaluate
from ..solvers.registry import Solver, SolveSettings, get_solver
from .errors import fixed_plan_too_big, infeasible
from .problem import Granularity, Problem

__all__ = ["Candidate", "Found", "NoFit", "SelectiveReplay", "apply_regions", "smallest_budget", "verified_plan",
           "solve_regions", "find_plan"]

# Attempts of solve -> generate -> verify at one budget; each tightens the limit by at least the
# stage model's error on the failed plan, and in practice the second attempt passes.
MAX_ATTEMPTS = 6
# Each retry also tightens the limit by this share of it, so a plan the stage model misjudges is
# not found again.
TIGHTEN = 0.005
# The share by which a plan must recompute less than another to replace it: the fine chain's
# plan the block chain's, a looser limit's plan the one in hand.  Nearer than that, noise in
# measured op times decides (the choice would differ from one op-time cache to the next), and a
# looser plan would cost a verification for nothing measurable (a Llama-7B shape's three rounds
# found plans 0.02% of the step apart, at 3.5 s of verification each).
TIE = 0.02
# Rounds that raise the solver's limit above the budget's when the plan found fits: the stage model
# is conservative (a stage's inputs, gradients and temporaries are bounds), and the verified plan
# may leave budget the model thought it used -- at every Llama layer's peak (8 x 512) by 12 MiB,
# on resnet50's fine chain by 28 MiB.  Each round is one more solve, and one more verification
# when its plan recomputes clearly less (TIE) than the best so far.
LOOSEN_ROUNDS = 3
# The first raise is at least this share of the limit (and the model's over-prediction, and the
# budget left): below it the table's slots barely move.
LOOSEN_STEP = 0.01


@dataclass
class Candidate:
    """A verified plan: its granularity, regions, generated module and predicted peak."""

    level: Granularity
    regions: tuple[Region, ...]
    module: fx.GraphModule
    peak: int  # predicted peak of one training step of ``module``
    attempts: int  # solve/verify rounds it took
    cost: Cost  # the stage model's peak (above resident) and recomputation, on the exact chain
    loosened: bool = False  # found above the budget's limit, by _loosen: solvers' optimum there


@dataclass
class Found:
    """What ``verified_plan`` returns: the verified plan, the budget in bytes (None: no budget), and the
    least recomputation any plan in remat's space has at that budget (None: none found)."""

    candidate: Candidate
    budget_bytes: int | None
    best_recompute_seconds: float | None


class NoFit(Exception):
    """No plan passed verification at a budget; ``best_peak`` is the lowest prediction seen."""

    def __init__(self, best_peak: int | None) -> None:
        super().__init__(best_peak)
        self.best_peak = best_peak


class SelectiveReplay(Exception):
    """torch's selective checkpoint refused a plan's recomputation in the simulation: the region
    runs ops in its recomputation that its forward did not (torch checks every op), so it would
    fail on the real run too.  The planner then plans again without selective regions."""


# What torch's selective checkpoint says when a recomputation does not replay its forward
# (torch/utils/checkpoint.py: _CachedTorchDispatchMode); any other error is not a replay problem.
_REPLAY_ERRORS = ("encountered during backward but not found in storage", "not found in storage",
                  "selective activation checkpoint", "checkpointed region")


def _selective(regions: tuple[Region, ...]) -> bool:
    return any(r.policy == SAVE_COMPUTE or _selective(r.children) for r in regions)


def _predict(problem: Problem, gm: fx.GraphModule, regions: tuple[Region, ...]) -> int:
    """The verified peak of ``gm``; a selective plan the simulation cannot replay raises SelectiveReplay."""
    try:
        return problem.predict(gm)
    except KeptOutputOverwritten as e:  # the profile refuses these regions: a guard, not a path
        raise SelectiveReplay(str(e)) from e
    except RuntimeError as e:
        if not _selective(regions) or not any(m in str(e) for m in _REPLAY_ERRORS):
            raise
        raise SelectiveReplay(str(e).splitlines()[0] if str(e) else type(e).__name__) from e


def _expand(regions: tuple[Region, ...], groups: list[tuple[int, int]]) -> tuple[Region, ...]:
    """Regions over coarse stages -> regions over the chain's stages."""
    return tuple(Region(groups[r.start][0], groups[r.stop - 1][1], _expand(r.children, groups), r.policy)
                 for r in regions)


def apply_regions(problem: Problem, regions: tuple[Region, ...], level: str = "blocks") -> fx.GraphModule:
    """The checkpointed module for ``regions`` over the stages of ``level``; with none, the step as
    the model runs it (its own checkpoint calls kept)."""
    return generate(problem.gm, problem.levels[level].chain, regions) if regions else problem.baseline


def _settings_for(problem: Problem, settings: SolveSettings) -> SolveSettings:
    """Sharded problems get no selective regions: torch's selective checkpoint replays the
    forward's op sequence exactly, and FSDP2's hooks run ``record_function`` ops that differ
    between the forward and the recomputation (a plan with one failed under FSDP2)."""
    return replace(settings, selective=False) if problem.shard is not None and settings.selective else settings


def solve_regions(problem: Problem, solver: Solver, limit: int,
                  settings: SolveSettings = SolveSettings()) -> tuple[Granularity, tuple[Region, ...], Cost] | None:
    """The plan whose modeled peak (above resident) fits ``limit`` with the least recomputation,
    with its cost on the exact chain.

    Budgeted solvers solve both granularities and keep the better plan (the fine chain can also
    checkpoint inside a residual block); the fixed plans use the block chain.
    """
    settings = _settings_for(problem, settings)
    levels = [problem.levels["blocks"]]
    if solver.budgeted and "fine" in problem.levels:
        levels.append(problem.levels["fine"])
    best: tuple[Granularity, tuple[Region, ...], Cost] | None = None
    for level in levels:
        # the 4x-slot retry near the floor only while no level has a plan (it costs 16x)
        tried = SolveSettings(settings.slots, settings.retry and best is None, settings.selective)
        regions = solver.regions(level.model, limit, tried) if len(level.model) else ()
        if regions is None:
            continue
        regions = _expand(regions, level.groups)
        cost = _cost(level, regions)
        # the finer chain only when it recomputes clearly less: near a tie, noise in measured op
        # times would make the choice (and the whole plan) differ from one cache to the next
        if best is None or cost.recompute < best[2].recompute * (1 - TIE):
            best = (level, regions, cost)
    return best


def least_regions(problem: Problem, solver: Solver, level: Granularity,
                  settings: SolveSettings) -> tuple[Region, ...]:
    """``solver``'s least-memory plan over ``level``'s coarse stages (cached on the problem)."""
    settings = _settings_for(problem, settings)
    key = (solver.name, level.name, settings)
    if key not in problem.least_regions:
        problem.least_regions[key] = solver.least(level.model, settings) if solver.least and len(level.model) else ()
    return problem.least_regions[key]


def _cost(level: Granularity, regions: tuple[Region, ...]) -> Cost:
    """The stage model's cost of ``regions`` on ``level``'s exact (uncoarsened) chain: the one
    place the planner asks the stage model (solvers ask it on their coarse chains)."""
    return evaluate(level.exact, regions)


def _unchanged(problem: Problem) -> Candidate:
    """The step as the model runs it (its own checkpoint calls kept): nothing recomputed by remat."""
    blocks = problem.levels["blocks"]
    return Candidate(blocks, (), problem.baseline, problem.unconstrained, 1, _cost(blocks, ()))


def find_plan(problem: Problem, solver: Solver, budget_bytes: int | None,
           settings: SolveSettings = SolveSettings(), verify: bool = True) -> Candidate:
    """Solve, generate and verify at one budget, tightening the solver's limit by each overshoot.

    Raises NoFit when no plan passes within MAX_ATTEMPTS.
    """
    # no budget: a fixed solver, which ignores the limit (verified_plan refuses a budgeted one)
    limit = (budget_bytes - problem.resident) if budget_bytes is not None else 0
    # the step fits as it is: a budgeted solver has nothing to recompute
    if solver.budgeted and budget_bytes is not None and problem.unconstrained <= budget_bytes:
        return _unchanged(problem)
    best: int | None = None
    margin = problem.margin
    for attempts in range(1, MAX_ATTEMPTS + 1):
        with progress.step("solve"):
            found = solve_regions(problem, solver, limit, settings)
        if found is None:
            raise NoFit(best)
        level, regions, cost = found
        modeled = problem.resident + cost.peak
        gm = apply_regions(problem, regions, level.name)
        if not regions:
            peak = problem.unconstrained  # the model's own step
        elif verify:
            with progress.step("verify"):
                peak = _predict(problem, gm, regions)
        else:
            peak = modeled
        # the model's own step needs no margin: it is what the user runs without remat
        if budget_bytes is None or (margin.budget_for(peak) if regions else peak) <= budget_bytes:
            found = Candidate(level, regions, gm, peak, attempts, cost)
            if solver.budgeted and verify and regions and budget_bytes is not None:
                found = _loosen(problem, solver, budget_bytes, limit, found, settings)
            return found
        best = peak if best is None else min(best, peak)
        if not solver.budgeted:
            break
        # tighten by the overshoot plus TIGHTEN, and at least by the stage model's error on this plan
        target = budget_bytes - margin.allowance(peak)
        limit = min(limit - (peak - target) - max(1, int(limit * TIGHTEN)),
                    target - problem.resident - max(0, peak - modeled))
    raise NoFit(best)


def _loosen(problem: Problem, solver: Solver, budget_bytes: int, limit: int, found: Candidate,
            settings: SolveSettings) -> Candidate:
    """``found`` (fits at ``limit``), or a plan recomputing less found at a higher limit that still
    verifies under the budget: the stage model over-predicts some plans (LOOSEN_ROUNDS).  The first
    raise is the model's over-prediction of ``found`` or the budget it leaves, whichever is more;
    then doubled after a fit, halved towards the last fit after an overshoot.  A plan that does
    not recompute clearly less than the best so far (TIE) is not verified, and counts as a fit:
    the search goes on above it; one the stage model puts clearly over the budget is not verified
    either (a Llama-7B shape's loosened plans: predicted and verified to 0.1%, 2 s a verification)."""
    margin = problem.margin
    best = found
    spare = budget_bytes - margin.budget_for(found.peak)
    over = problem.resident + found.cost.peak - found.peak
    step = max(over, spare, int(limit * LOOSEN_STEP))
    fits_at, fails_at = 0, None
    for _ in range(LOOSEN_ROUNDS):
        with progress.step("solve", "a looser limit: the stage model over-predicted the plan"):
            got = solve_regions(problem, solver, limit + step, settings)
        # nothing clearly better to verify
        fits = got is None or got[2].recompute >= best.cost.recompute * (1 - TIE)
        # nor one the stage model puts over the budget by more than twice its error on ``found``
        # (its error varies between plans: 0 to 2 MiB on GPT-2 and Llama on meta): it counts as an overshoot
        if not fits and margin.budget_for(problem.resident + got[2].peak - 2 * max(0, over)) <= budget_bytes:
            level, regions, cost = got
            gm = apply_regions(problem, regions, level.name)
            try:
                with progress.step("verify"):
                    peak = _predict(problem, gm, regions)
            except SelectiveReplay:
                break  # the plan at the budget's limit stands
            fits = margin.budget_for(peak) <= budget_bytes
            if fits:
                best = Candidate(level, regions, gm, peak, best.attempts + 1, cost, loosened=True)
        if fits:
            fits_at = step
            step = 2 * step if fails_at is None else (step + fails_at) // 2
        else:
            fails_at = step
            step = (fits_at + step) // 2
        if step <= fits_at or (fails_at is not None and step >= fails_at):
            break
    return best


def _least_candidate(problem: Problem, solver: Solver, level: Granularity, settings: SolveSettings,
                     verify: bool) -> Candidate | None:
    """``solver``'s least-memory plan on ``level``, generated and verified (None: no regions)."""
    regions = _expand(least_regions(problem, solver, level, settings), level.groups)
    if not regions:
        return None
    gm = apply_regions(problem, regions, level.name)
    cost = _cost(level, regions)
    if verify:
        with progress.step("verify", "the least-memory plan"):
            peak = _predict(problem, gm, regions)
    else:
        peak = problem.resident + cost.peak
    return Candidate(level, regions, gm, peak, 1, cost)


def smallest_budget(problem: Problem, solver: Solver, settings: SolveSettings = SolveSettings(),
                    verify: bool = True) -> tuple[int, Candidate]:
    """The smallest budget (bytes) at which ``solver`` has a verified plan, and that plan.

    Direct, not searched: the solver's least-memory plan on each granularity (rotor: the first
    feasible column of one DP table) is generated and verified once; the budget it needs is its
    predicted peak plus the margin.  When that is not below the step without checkpointing, the
    model's own step is the plan.
    """
    best: Candidate | None = None
    if solver.least is not None:
        for level in problem.levels.values():
            found = _least_candidate(problem, solver, level, settings, verify)
            if found is not None and settings.selective and found.peak > problem.resident + found.cost.peak:
                # The stage model under-predicted a plan with selective regions (one nested in a
                # plain region: Llama 8 x 512, 28 MiB): the same least memory without them may
                # verify lower.  Only then is the second plan solved and verified.
                plain = _least_candidate(problem, solver, level, replace(settings, selective=False), verify)
                if plain is not None and plain.peak < found.peak:
                    found = plain
            if found is not None and (best is None or found.peak < best.peak):
                best = found
    if best is None or problem.margin.budget_for(best.peak) >= problem.unconstrained:
        return problem.unconstrained, _unchanged(problem)
    return problem.margin.budget_for(best.peak), best


def verified_plan(problem: Problem, solver: Solver, budget: Budget | None, settings: SolveSettings,
                  verify: bool = True) -> Found:
    """The verified plan at the budget (``budget.minimum``: at the smallest budget that has one).

    When nothing passes at the budget, the smallest budget that does is found (the least-memory
    plan, verified once); it is reported in InfeasibleBudget, or, should that plan fit the budget
    after all, it is returned.
    """
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
    return Found(found, budget_bytes, _best_seconds(problem, solver, found, budget_bytes, settings))


def _best_seconds(problem: Problem, solver: Solver, found: Candidate, budget_bytes: int | None,
                  settings: SolveSettings) -> float | None:
    """The least recomputation time any plan in remat's space has at the budget (the plan's peak
    when there is none), by rotor's optimum on the stage model: the plan's own when an optimal
    solver found it at the first attempt, else one more solve."""
    if not found.regions:
        return 0.0
    if solver.optimal and (found.attempts == 1 or found.loosened):
        return found.cost.recompute
    budget = budget_bytes if budget_bytes is not None else problem.margin.budget_for(found.peak)
    limit = budget - problem.resident  # as find_plan's first solve
    best = solve_regions(problem, get_solver("rotor"), limit, replace(settings, retry=False))
    return found.cost.recompute if best is None else min(best[2].recompute, found.cost.recompute)

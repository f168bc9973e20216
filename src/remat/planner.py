"""From a model and a budget to a verified checkpointed module.

Trace and profile once, linearize, then solve on the stage-level model; the generated module is
simulated on fake tensors and, if its predicted peak is above the budget, the solver's limit is
tightened by the overshoot and it solves again.  When nothing fits, ``InfeasibleBudget`` names the
smallest budget the rotor optimum needs.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
import torch
from torch import fx

from .budget import Budget
from .chain import Chain, linearize
from .codegen import generate
from .errors import InfeasibleBudget
from .profiler.model import ModelProfile, profile_graph
from .profiler.step import simulate_step
from .sharding import SHARDINGS, ShardModel, shard_chain, shard_model
from .solvers.base import Plan, Region
from .solvers.chen import greedy_candidates, greedy_regions, sqrtn_regions
from .solvers.model import ChainModel, evaluate, recompute_flops
from .solvers.rotor import solve_rotor, solve_table
from .trace import trace
from .units import fmt_bytes

__all__ = ["SOLVERS", "Problem", "prepare", "plan_problem", "apply_regions", "smallest_budget"]

SOLVERS = ("rotor", "chen-greedy", "chen-sqrtn", "every-stage", "none")
BUDGETED = ("rotor", "chen-greedy")
MAX_ATTEMPTS = 6
# The fake-tensor prediction matches real CPU peaks within ~0.1 % (benchmarks/memory.py, the tests);
# a verified plan must leave this much of the budget unused so a real run stays inside it.
VERIFY_MARGIN = 0.0025


@dataclass
class Granularity:
    """One linearization of the graph and the (possibly coarsened) stage model solvers see."""

    name: str  # "blocks": no skip connection crosses a cut; "fine": cuts inside blocks too
    chain: Chain
    model: ChainModel
    groups: list[tuple[int, int]]  # model stage -> chain stages [a, b)


@dataclass
class Problem:
    """Everything solving needs, computed once per model and input shape."""

    gm: fx.GraphModule
    args: tuple
    kwargs: dict
    profile: ModelProfile
    levels: dict[str, Granularity] = field(default_factory=dict)
    shard: ShardModel | None = None  # FSDP2 planning: per-process terms (sharding.py)
    sharded_peak: int = 0  # the unconstrained step's predicted per-process peak, when sharded

    @property
    def chain(self) -> Chain:
        return self.levels["blocks"].chain

    @property
    def model(self) -> ChainModel:
        return self.levels["blocks"].model

    @property
    def resident(self) -> int:
        """Bytes outside the stage model: resident before the step (with FSDP2, per process, plus
        the allowance for its gathered units and collective buffers)."""
        if self.shard is not None:
            return self.shard.resident + self.shard.allowance
        return self.profile.resident_bytes

    @property
    def fixed(self) -> int:
        """Resident bytes plus every parameter gradient: the floor no schedule goes below."""
        grads = self.profile.grad_bytes
        return self.resident + (self.shard.grad_bytes(grads) if self.shard is not None else grads)

    @property
    def unconstrained(self) -> int:
        return self.sharded_peak if self.shard is not None else self.profile.peak_bytes

    def predict(self, gm: fx.GraphModule) -> int:
        """Predicted peak of one training step of ``gm`` (a generated module of this problem)."""
        if self.shard is None:
            return simulate_step(gm, self.args, self.kwargs).peak
        step = simulate_step(gm, self.args, self.kwargs, self.shard.grad_shards)
        return self.resident + step.peak_above


def _coarsen(model: ChainModel, max_stages: int) -> tuple[ChainModel, list[tuple[int, int]]]:
    """Merge neighbouring stages (cheapest pair first) until at most ``max_stages`` remain."""
    groups = [(i, i + 1) for i in range(len(model))]
    f = list(model.f)
    while len(groups) > max_stages:
        j = min(range(len(groups) - 1), key=lambda i: f[i] + f[i + 1])
        groups[j:j + 2] = [(groups[j][0], groups[j + 1][1])]
        f[j:j + 2] = [f[j] + f[j + 1]]
    if len(groups) == len(model):
        return model, groups

    def pick(a: int, b: int):
        return (sum(model.f[a:b]), model.x[a], model.y[b - 1], sum(model.xbar[a:b]),
                max(model.ftmp[a:b]), max(model.btmp[a:b]) + sum(model.g[a:b]), sum(model.g[a:b]),
                max(model.fdis[a:b]) + max(model.y[a:b]) + max(model.skip[a:b]), model.skip[b - 1],
                model.skip_from[b - 1])

    cols = [tuple(c) for c in zip(*(pick(a, b) for a, b in groups))]
    # skip producers are indices of the fine model; map them to merged stages
    where = {i: g for g, (a, b) in enumerate(groups) for i in range(a, b)}
    cols[9] = tuple(where.get(j, -1) if j >= 0 else -1 for j in cols[9])
    return ChainModel(*cols), groups


def prepare(model: torch.nn.Module, args: tuple, kwargs: dict | None = None,
            shared_inputs: tuple[str, ...] = (), max_stages: int = 128, *,
            world_size: int = 1, sharding: str | None = None) -> Problem:
    """Trace, profile and linearize once; ``sharding="fsdp"`` plans per process (sharding.py)."""
    if sharding not in (None, *SHARDINGS):
        raise ValueError(f"unknown sharding {sharding!r}; choose None or one of {', '.join(SHARDINGS)}")
    if sharding is None and world_size != 1:
        raise ValueError("world_size only changes the plan with sharding='fsdp'; under DDP every process "
                         "holds the whole model, so plan with the defaults")
    gm = trace(model, args, kwargs)
    prof = profile_graph(gm, args, kwargs)
    problem = Problem(gm, args, kwargs or {}, prof)
    if sharding == "fsdp":
        problem.shard = shard_model(gm, world_size, prof.buffer_bytes + prof.input_bytes)
        problem.sharded_peak = problem.predict(gm)
    for name, split in (("blocks", False), ("fine", True)):
        chain = linearize(gm, shared_inputs, split_blocks=split)
        if problem.shard is not None:
            chain = shard_chain(chain, problem.shard)
        coarse, groups = _coarsen(ChainModel.from_chain(chain), max_stages)
        problem.levels[name] = Granularity(name, chain, coarse, groups)
    if len(problem.levels["fine"].chain) == len(problem.chain):
        del problem.levels["fine"]  # no block to split
    return problem


def _expand(regions: tuple[Region, ...], groups: list[tuple[int, int]]) -> tuple[Region, ...]:
    """Regions over coarse stages -> regions over the chain's stages."""
    return tuple(Region(groups[r.start][0], groups[r.stop - 1][1], _expand(r.children, groups)) for r in regions)


def _solve_level(level: Granularity, solver: str, limit: int, slots: int,
                 retry: bool = True) -> tuple[Region, ...] | None:
    model = level.model
    if solver == "none" or len(model) == 0:
        regions: tuple[Region, ...] | None = ()
    elif solver == "every-stage":
        regions = tuple(Region(i, i + 1) for i in range(len(model)))
    elif solver == "chen-sqrtn":
        regions = sqrtn_regions(len(model))
    elif solver == "chen-greedy":
        regions = greedy_regions(model, limit)
    elif solver == "rotor":
        regions = solve_rotor(model, limit, slots, retry)
    else:
        raise ValueError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")
    return None if regions is None else _expand(regions, level.groups)


def solve_regions(problem: Problem, solver: str, limit: int,
                  slots: int = 500) -> tuple[Granularity, tuple[Region, ...]] | None:
    """The plan whose modeled peak (above resident) fits ``limit`` with the least recomputation.

    rotor and chen-greedy solve both granularities and keep the better plan (the fine chain can
    also checkpoint inside a residual block); the fixed plans use the block chain.
    """
    levels = [problem.levels["blocks"]]
    if solver in ("rotor", "chen-greedy") and "fine" in problem.levels:
        levels.append(problem.levels["fine"])
    best: tuple[int, Granularity, tuple[Region, ...]] | None = None
    for level in levels:
        # the 4x-slot retry near the floor only while no level has a plan (it costs 16x)
        regions = _solve_level(level, solver, limit, slots, retry=best is None)
        if regions is None:
            continue
        work = recompute_flops(ChainModel.from_chain(level.chain), regions)
        if best is None or work < best[0]:
            best = (work, level, regions)
    return None if best is None else (best[1], best[2])


def min_feasible_bytes(problem: Problem, slots: int = 500, solver: str = "rotor") -> int:
    """The smallest absolute budget ``solver``'s least-memory plan fits under the stage model
    (rotor: the DP optimum; chen-greedy: its best candidate), before any verification."""
    need = []
    for level in problem.levels.values():
        top = evaluate(level.model, ()).peak
        if solver == "chen-greedy":
            need.append(min(evaluate(level.model, r).peak for r in greedy_candidates(level.model)))
            continue
        table = solve_table(level.model, max(top, 1), slots)
        m = table.min_feasible_slot()
        need.append(top if m is None else int(m * table.slot))
    return problem.resident + min(need)


def apply_regions(problem: Problem, regions: tuple[Region, ...], level: str = "blocks") -> fx.GraphModule:
    return generate(problem.gm, problem.levels[level].chain, regions) if regions else problem.gm


class _NoFit(Exception):
    """No plan passed verification at a budget; ``best_peak`` is the lowest prediction seen."""

    def __init__(self, best_peak: int | None) -> None:
        super().__init__(best_peak)
        self.best_peak = best_peak


def _search(problem: Problem, solver: str, budget_bytes: int | None, slots: int,
            verify: bool) -> tuple[Granularity, tuple[Region, ...], fx.GraphModule, int, int]:
    """Solve, generate and verify at one budget, tightening the solver's limit by each overshoot.

    Returns (level, regions, module, predicted peak, attempts) or raises _NoFit.
    """
    limit = (budget_bytes - problem.resident) if budget_bytes is not None else evaluate(problem.model, ()).peak
    level = problem.levels["blocks"]
    # the step fits as it is: a budgeted solver has nothing to recompute
    if solver in BUDGETED and budget_bytes is not None and problem.unconstrained <= budget_bytes:
        return level, (), problem.gm, problem.unconstrained, 1
    best: int | None = None
    for attempts in range(1, MAX_ATTEMPTS + 1):
        found = solve_regions(problem, solver, limit, slots)
        if found is None:
            raise _NoFit(best)
        level, regions = found
        gm = apply_regions(problem, regions, level.name)
        if not regions:
            peak = problem.unconstrained
        elif verify:
            peak = problem.predict(gm)
        else:
            peak = problem.resident + evaluate(ChainModel.from_chain(level.chain), regions).peak
        # no checkpointing is the traced model itself, whose prediction is the unconstrained peak
        margin = VERIFY_MARGIN if regions else 0.0
        if budget_bytes is None or peak <= budget_bytes * (1 - margin):
            return level, regions, gm, peak, attempts
        best = peak if best is None else min(best, peak)
        if solver not in BUDGETED:
            break
        # tighten by the overshoot plus 0.5 %, and at least by the stage model's error on this plan
        target = int(budget_bytes * (1 - VERIFY_MARGIN))
        modeled = problem.resident + evaluate(ChainModel.from_chain(level.chain), regions).peak
        limit = min(limit - (peak - target) - max(1, limit // 200), target - problem.resident - max(0, peak - modeled))
    raise _NoFit(best)


FLOOR_ROUNDS = 4  # upward steps from the stage model's floor, then as many bisection steps down


def smallest_budget(problem: Problem, solver: str, slots: int = 500,
                    verify: bool = True) -> tuple[int, tuple[Granularity, tuple[Region, ...], fx.GraphModule, int, int]]:
    """The smallest budget (bytes) at which ``solver`` returns a verified plan, and that plan.

    Searched upward from the stage model's floor: each failed budget is raised to what its best
    plan was predicted to need (plus the verification margin); the unconstrained peak, where no
    checkpointing is needed, always fits. A few bisection steps then narrow the gap between the
    last budget that failed and the first that passed.
    """
    low, candidate = 0, min(min_feasible_bytes(problem, slots, solver), problem.unconstrained)
    found = None
    for _ in range(FLOOR_ROUNDS):
        if candidate >= problem.unconstrained:
            break
        try:
            found = _search(problem, solver, candidate, slots, verify)
            break
        except _NoFit as e:
            low = candidate
            need = math.ceil(e.best_peak / (1 - VERIFY_MARGIN)) + 1 if e.best_peak is not None else 0
            candidate = max(need, candidate + max(1, candidate // 200))
    if found is None:
        candidate = problem.unconstrained
        found = _search(problem, solver, candidate, slots, verify)
    # the stage model's floor is rounded up to its memory slots: the true floor may lie below it
    low = low or max(problem.fixed, candidate - 2 * max(1, problem.unconstrained - problem.resident) // slots)
    for _ in range(FLOOR_ROUNDS):
        middle = (low + candidate) // 2
        if candidate - low <= max(1024, candidate // 1000):
            break
        try:
            found, candidate = _search(problem, solver, middle, slots, verify), middle
        except _NoFit:
            low = middle
    return candidate, found


def _infeasible(problem: Problem, budget_bytes: int, solver: str, need: int) -> InfeasibleBudget:
    span = max(1, problem.unconstrained - problem.fixed)
    fraction = min(1.0, (need - problem.fixed) / span)
    if need >= problem.unconstrained:
        return InfeasibleBudget(
            f"no {solver} schedule fits a budget of {budget_bytes} bytes ({fmt_bytes(budget_bytes)}): checkpointing "
            f"cannot lower this step's peak of {fmt_bytes(problem.unconstrained)}. It comes where little but "
            f"parameters and their gradients is alive (fixed: {fmt_bytes(problem.fixed)}), typically at the end "
            f"of the backward; the smallest feasible budget is {need} bytes, a fraction of 1.0", need, 1.0)
    return InfeasibleBudget(
        f"no {solver} schedule fits a budget of {budget_bytes} bytes ({fmt_bytes(budget_bytes)}); the smallest "
        f"feasible budget is {need} bytes ({fmt_bytes(need)}), a fraction of {fraction:.3f}, where a verified "
        f"{solver} plan exists (fixed: {fmt_bytes(problem.fixed)} of parameters, buffers, inputs and gradients; "
        f"unconstrained step: {fmt_bytes(problem.unconstrained)})", need, fraction)


def _fixed_plan_too_big(problem: Problem, budget_bytes: int, solver: str, peak: int | None) -> InfeasibleBudget:
    need = math.ceil((peak or problem.unconstrained) / (1 - VERIFY_MARGIN))
    fraction = (need - problem.fixed) / max(1, problem.unconstrained - problem.fixed)
    return InfeasibleBudget(
        f"the {solver} plan does not fit a budget of {budget_bytes} bytes ({fmt_bytes(budget_bytes)}): its "
        f"predicted peak is {fmt_bytes(peak or 0)}, so it needs {need} bytes (a fraction of {fraction:.3f}); "
        f"solver='rotor' finds the least recomputation under a budget", need, fraction)


def plan_problem(problem: Problem, solver: str, budget: Budget | None, slots: int = 500,
                 verify: bool = True) -> tuple[fx.GraphModule, Plan]:
    """Solve, generate and verify; returns the module and its Plan (or raises InfeasibleBudget).

    When nothing passes at the budget, the smallest budget that does is searched; it is reported
    in InfeasibleBudget, or, should it lie within the budget after all, its plan is returned.
    """
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")
    start = time.perf_counter()
    budget_bytes = None if budget is None else budget.resolve(problem.fixed, problem.unconstrained)
    if budget_bytes is None and solver in BUDGETED:
        raise ValueError(f"solver {solver!r} needs a budget")
    try:
        level, regions, gm, peak, attempts = _search(problem, solver, budget_bytes, slots, verify)
    except _NoFit as e:
        if solver not in BUDGETED:
            raise _fixed_plan_too_big(problem, budget_bytes or 0, solver, e.best_peak) from None
        need, found = smallest_budget(problem, solver, slots, verify)
        if need > budget_bytes:
            raise _infeasible(problem, budget_bytes, solver, need) from None
        level, regions, gm, peak, attempts = found
    plan = Plan(
        solver=solver, budget_bytes=budget_bytes, predicted_peak_bytes=peak,
        recompute_flops=recompute_flops(ChainModel.from_chain(level.chain), regions),
        stages=[list(s.nodes) for s in level.chain.stages], regions=regions,
        step_flops=problem.profile.fwd_flops + problem.profile.bwd_flops,
        info={"unconstrained_peak_bytes": problem.unconstrained, "fixed_bytes": problem.fixed,
              "resident_bytes": problem.resident, "solve_seconds": round(time.perf_counter() - start, 3),
              "attempts": attempts, "frontend": problem.profile.frontend, "slots": slots,
              "granularity": level.name,
              **({"world_size": problem.shard.world_size, "sharding": "fsdp"} if problem.shard else {})},
    )
    gm.remat_plan = plan
    return gm, plan

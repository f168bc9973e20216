"""From a model and a budget to a verified checkpointed module.

Trace and profile once, linearize, then solve on the stage-level model; the generated module is
simulated on fake tensors and, if its predicted peak is above the budget, the solver's limit is
tightened by the overshoot and it solves again.  When nothing fits, ``InfeasibleBudget`` names the
smallest budget the rotor optimum needs.
"""
from __future__ import annotations

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
from .solvers.base import Plan, Region
from .solvers.chen import greedy_regions, sqrtn_regions
from .solvers.model import ChainModel, evaluate, recompute_flops
from .solvers.rotor import rotor_regions, solve_table
from .trace import trace
from .units import fmt_bytes

__all__ = ["SOLVERS", "Problem", "prepare", "plan_problem", "apply_regions"]

SOLVERS = ("rotor", "chen-greedy", "chen-sqrtn", "every-stage", "none")
BUDGETED = ("rotor", "chen-greedy")
MAX_ATTEMPTS = 6


@dataclass
class Problem:
    """Everything solving needs, computed once per model and input shape."""

    gm: fx.GraphModule
    args: tuple
    kwargs: dict
    profile: ModelProfile
    chain: Chain
    model: ChainModel
    stage_groups: list[tuple[int, int]] = field(default_factory=list)  # coarse stage -> chain stages

    @property
    def resident(self) -> int:
        return self.profile.resident_bytes

    @property
    def fixed(self) -> int:
        """Resident bytes plus every parameter gradient: the floor no schedule goes below."""
        return self.profile.resident_bytes + self.profile.grad_bytes

    @property
    def unconstrained(self) -> int:
        return self.profile.peak_bytes


def _coarsen(model: ChainModel, max_stages: int) -> tuple[ChainModel, list[tuple[int, int]]]:
    """Merge neighbouring stages (cheapest pair first) until at most ``max_stages`` remain."""
    groups = [(i, i + 1) for i in range(len(model))]
    f = list(model.f)
    while len(groups) > max_stages:
        j = min(range(len(groups) - 1), key=lambda i: f[i] + f[i + 1])
        groups[j:j + 2] = [(groups[j][0], groups[j + 1][1])]
        f[j:j + 2] = [f[j] + f[j + 1]]

    def pick(a: int, b: int):
        return (sum(model.f[a:b]), model.x[a], model.y[b - 1], sum(model.xbar[a:b]),
                max(model.ftmp[a:b]), max(model.btmp[a:b]) + sum(model.g[a:b]), sum(model.g[a:b]),
                max(model.fdis[a:b]) + max(model.y[a:b]))

    cols = list(zip(*(pick(a, b) for a, b in groups)))
    return ChainModel(*(tuple(c) for c in cols)), groups


def prepare(model: torch.nn.Module, args: tuple, kwargs: dict | None = None,
            shared_inputs: tuple[str, ...] = (), max_stages: int = 128) -> Problem:
    gm = trace(model, args, kwargs)
    prof = profile_graph(gm, args, kwargs)
    chain = linearize(gm, shared_inputs)
    full = ChainModel.from_chain(chain)
    coarse, groups = _coarsen(full, max_stages)
    return Problem(gm, args, kwargs or {}, prof, chain, coarse, groups)


def _expand(regions: tuple[Region, ...], groups: list[tuple[int, int]]) -> tuple[Region, ...]:
    """Regions over coarse stages -> regions over the chain's stages."""
    return tuple(Region(groups[r.start][0], groups[r.stop - 1][1], _expand(r.children, groups)) for r in regions)


def solve_regions(problem: Problem, solver: str, limit: int, slots: int = 500) -> tuple[Region, ...] | None:
    """Regions over the chain's stages whose modeled peak (above resident) fits ``limit``, or None."""
    model = problem.model
    if solver == "none" or len(model) == 0:
        regions: tuple[Region, ...] | None = ()
    elif solver == "every-stage":
        regions = tuple(Region(i, i + 1) for i in range(len(model)))
    elif solver == "chen-sqrtn":
        regions = sqrtn_regions(len(model))
    elif solver == "chen-greedy":
        regions = greedy_regions(model, limit)
    elif solver == "rotor":
        regions = rotor_regions(solve_table(model, max(limit, 0), slots)) if limit > 0 else None
    else:
        raise ValueError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")
    return None if regions is None else _expand(regions, problem.stage_groups)


def min_feasible_bytes(problem: Problem, slots: int = 500) -> int:
    """The smallest absolute budget the rotor optimum fits under the stage model."""
    top = evaluate(problem.model, ()).peak
    table = solve_table(problem.model, max(top, 1), slots)
    m = table.min_feasible_slot()
    return problem.resident + (top if m is None else int(m * table.slot))


def apply_regions(problem: Problem, regions: tuple[Region, ...]) -> fx.GraphModule:
    return generate(problem.gm, problem.chain, regions) if regions else problem.gm


def _infeasible(problem: Problem, budget_bytes: int, solver: str, slots: int) -> InfeasibleBudget:
    need = min_feasible_bytes(problem, slots)
    span = max(1, problem.unconstrained - problem.fixed)
    fraction = (need - problem.fixed) / span
    return InfeasibleBudget(
        f"no {solver} schedule fits a budget of {budget_bytes} bytes ({fmt_bytes(budget_bytes)}); the smallest "
        f"feasible budget is about {need} bytes ({fmt_bytes(need)}), a fraction of {fraction:.3f} (fixed: "
        f"{fmt_bytes(problem.fixed)} of parameters, buffers, inputs and gradients; unconstrained step: "
        f"{fmt_bytes(problem.unconstrained)})", need, fraction)


def plan_problem(problem: Problem, solver: str, budget: Budget | None, slots: int = 500,
                 verify: bool = True) -> tuple[fx.GraphModule, Plan]:
    """Solve, generate and verify; returns the module and its Plan (or raises InfeasibleBudget)."""
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")
    start = time.perf_counter()
    budget_bytes = None if budget is None else budget.resolve(problem.fixed, problem.unconstrained)
    if budget_bytes is None and solver in BUDGETED:
        raise ValueError(f"solver {solver!r} needs a budget")
    limit = (budget_bytes - problem.resident) if budget_bytes is not None else evaluate(problem.model, ()).peak
    attempts, gm, regions, peak = 0, problem.gm, (), problem.unconstrained
    while True:
        attempts += 1
        found = solve_regions(problem, solver, limit, slots)
        if found is None:
            raise _infeasible(problem, budget_bytes or 0, solver, slots)
        regions = found
        gm = apply_regions(problem, regions)
        peak = simulate_step(gm, problem.args, problem.kwargs).peak if (verify and regions) else (
            problem.unconstrained if not regions else problem.resident + evaluate(problem.model, regions).peak)
        if budget_bytes is None or peak <= budget_bytes:
            break
        if solver not in BUDGETED or attempts >= MAX_ATTEMPTS:
            raise _infeasible(problem, budget_bytes, solver, slots)
        limit -= (peak - budget_bytes) + max(1, limit // 200)  # tighten by the overshoot, plus 0.5 %
    chain_model = ChainModel.from_chain(problem.chain)
    plan = Plan(
        solver=solver, budget_bytes=budget_bytes, predicted_peak_bytes=peak,
        recompute_flops=recompute_flops(chain_model, regions),
        stages=[list(s.nodes) for s in problem.chain.stages], regions=regions,
        step_flops=problem.profile.fwd_flops + problem.profile.bwd_flops,
        info={"unconstrained_peak_bytes": problem.unconstrained, "fixed_bytes": problem.fixed,
              "resident_bytes": problem.resident, "solve_seconds": round(time.perf_counter() - start, 3),
              "attempts": attempts, "frontend": problem.profile.frontend, "slots": slots},
    )
    gm.remat_plan = plan
    return gm, plan

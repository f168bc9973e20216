"""The messages of InfeasibleBudget: what did not fit, the smallest budget that does, and the
least any checkpointing could reach."""
from __future__ import annotations

from ..errors import InfeasibleBudget
from ..units import fmt_bytes
from .problem import Problem

__all__ = ["infeasible", "fixed_plan_too_big"]


def _bound(problem: Problem, budget_bytes: int) -> tuple[str, int | None]:
    """A sentence on the bound no checkpointing goes below (profiler/bound.py), and its bytes."""
    bound = problem.bound
    if bound is None:
        return "", None
    what = f"{fmt_bytes(bound.bytes)} (bound_bytes; {bound.reason})"
    if budget_bytes < bound.bytes:
        return (f". No checkpointing of this model's code, remat's or by hand, goes below {what}: this budget "
                "needs a smaller batch, lower precision, sharding or offloading"), bound.bytes
    return f". No checkpointing of this model's code goes below {what}", bound.bytes


def infeasible(problem: Problem, budget_bytes: int, solver: str, need: int) -> InfeasibleBudget:
    """No ``solver`` plan fits ``budget_bytes``; ``need`` is the smallest verified budget."""
    span = max(1, problem.unconstrained - problem.fixed)
    fraction = min(1.0, (need - problem.fixed) / span)
    bound, bound_bytes = _bound(problem, budget_bytes)
    if need >= problem.unconstrained and problem.user_regions:
        return InfeasibleBudget(
            f"no {solver} schedule fits a budget of {budget_bytes} bytes ({fmt_bytes(budget_bytes)}): the model's own "
            f"checkpoint calls already bring the step to {fmt_bytes(problem.unconstrained)} and remat finds no plan "
            f"below that (without them the step needs {fmt_bytes(problem.profile.inlined_peak_bytes)}); the smallest "
            f"feasible budget is {need} bytes, a fraction of 1.0{bound}", need, 1.0, bound_bytes)
    if need >= problem.unconstrained:
        return InfeasibleBudget(
            f"no {solver} schedule fits a budget of {budget_bytes} bytes ({fmt_bytes(budget_bytes)}): checkpointing "
            f"cannot lower this step's peak of {fmt_bytes(problem.unconstrained)}. It comes where nothing a "
            f"checkpoint drops is alive: near the end of the backward, among the parameters and their gradients "
            f"(fixed: {fmt_bytes(problem.fixed)}), or inside one op or graph node no checkpoint splits (a whole "
            f"nn.LSTM, say); the smallest feasible budget is {need} bytes, a fraction of 1.0{bound}",
            need, 1.0, bound_bytes)
    return InfeasibleBudget(
        f"no {solver} schedule fits a budget of {budget_bytes} bytes ({fmt_bytes(budget_bytes)}); the smallest "
        f"feasible budget is {need} bytes ({fmt_bytes(need)}), a fraction of {fraction:.3f}, where a verified "
        f"{solver} plan exists (fixed: {fmt_bytes(problem.fixed)} of parameters, buffers, inputs and gradients; "
        f"unconstrained step: {fmt_bytes(problem.unconstrained)}){bound}", need, fraction, bound_bytes)


def fixed_plan_too_big(problem: Problem, budget_bytes: int, solver: str, peak: int | None) -> InfeasibleBudget:
    """A fixed plan (every-stage, chen-sqrtn) is over the budget; say what it needs."""
    need = problem.margin.budget_for(peak) if peak else problem.unconstrained
    fraction = (need - problem.fixed) / max(1, problem.unconstrained - problem.fixed)
    what = ("solver 'none' checkpoints nothing: its plan is the step as the model runs it, budget 1.0; it "
            if solver == "none" else f"the {solver} plan ")
    return InfeasibleBudget(
        f"{what}does not fit a budget of {budget_bytes} bytes ({fmt_bytes(budget_bytes)}): its "
        f"predicted peak is {fmt_bytes(peak or 0)}, so it needs {need} bytes (a fraction of {fraction:.3f}); "
        f"solver='rotor' finds the least recomputation under a budget", need, fraction,
        problem.bound.bytes if problem.bound else None)

"""The public entry points (DESIGN.md's contract): profile, count_flops, measure_peak, checkpoint."""
from __future__ import annotations

from typing import Any

import torch

from torch import fx

from .budget import parse_budget
from .errors import public
from .planner import Problem, apply_regions, plan_problem, prepare
from .planner.problem import trace_and_profile
from .profiler.model import ModelProfile, profile_graph
from .solvers.base import Plan
from .solvers.registry import DEFAULT_SLOTS, SolveSettings, get_solver
from .trace import trace

__all__ = ["profile", "checkpoint", "apply_plan"]


def _as_args(example_inputs: Any) -> tuple:
    return tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)


@public
def profile(model: torch.nn.Module, example_inputs: Any = (), kwargs: dict | None = None, *,
            calibrate: bool | None = None) -> ModelProfile:
    """Predict FLOPs, per-node memory and the peak of one training step, on fake tensors.

    The model is traced (it is not modified) and its step simulated without allocating real
    memory: ``example_inputs`` may live on the meta device.  Kernel scratch is measured op by op
    on this machine when the inputs are real CPU tensors (``calibrate=None``; True/False force it),
    else bounded by the memory rules.
    """
    return trace_and_profile(model, _as_args(example_inputs), kwargs, calibrate).profile


@public
def checkpoint(model: torch.nn.Module, example_inputs: Any = (), kwargs: dict | None = None, *,
               budget: int | float | str | None = None, solver: str = "rotor",
               shared_inputs: tuple[str, ...] = (), slots: int = DEFAULT_SLOTS,
               world_size: int = 1, sharding: str | None = None, calibrate: bool | None = None) -> fx.GraphModule:
    """A GraphModule that trains like ``model`` within ``budget``, recomputing what it must.

    ``budget``: bytes (int), a size ("1.5GiB", "800MB"), or a fraction in (0, 1] of what
    checkpointing can save (DESIGN.md); rotor and chen-greedy default to 0.5.  ``solver``: rotor
    (optimal), chen-greedy, chen-sqrtn, every-stage or none.  The result shares ``model``'s
    parameters and buffers under the same names; ``gm.remat_plan`` is the verified Plan and
    ``gm.code`` shows the checkpoint regions.  Raises InfeasibleBudget when nothing fits.

    ``sharding="fsdp"`` with ``world_size=N`` plans one process of FSDP2 training: the budget is
    per process, parameters and gradients are sharded N ways, and ``example_inputs`` is one
    process's batch.  Wrap the result with ``remat.fully_shard(gm, mesh)``, the layout the
    prediction assumes (src/remat/sharding.py says what it includes).
    """
    if budget is None and get_solver(solver).budgeted:
        budget = 0.5
    parsed = None if budget is None else parse_budget(budget)
    problem = prepare(model, _as_args(example_inputs), kwargs, tuple(shared_inputs),
                      world_size=world_size, sharding=sharding, calibrate=calibrate)
    gm, plan = plan_problem(problem, solver, parsed, SolveSettings(slots=slots))
    return _agree_across_ranks(problem, gm, plan)


def _agree_across_ranks(problem: Problem, gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Every process of a distributed job runs rank 0's plan.

    Costs include op times measured on each process, which differ by noise; two ranks choosing
    different regions would issue FSDP's collectives in different orders and hang.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1):
        return gm
    shared = [plan]
    torch.distributed.broadcast_object_list(shared, src=0)
    chosen: Plan = shared[0]
    if chosen.regions == plan.regions and chosen.info.get("granularity") == plan.info.get("granularity"):
        return gm
    level = chosen.info.get("granularity", "blocks")
    if level not in problem.levels or [list(s.nodes) for s in problem.levels[level].chain.stages] != chosen.stages:
        raise RuntimeError("rank 0 traced this model to other stages than this process: the processes of one "
                           "job must plan the same model on inputs of the same shapes")
    gm = apply_regions(problem, tuple(chosen.regions), level)
    gm.remat_plan = chosen
    return gm


@public
def apply_plan(model: torch.nn.Module, example_inputs: Any, plan: Plan, kwargs: dict | None = None, *,
               shared_inputs: tuple[str, ...] = (), allow_other_shapes: bool = False) -> fx.GraphModule:
    """Re-apply a saved plan without solving; the model must trace to the same stages.

    A plan holds for the input shapes it was made for (``plan.info["inputs"]``): inputs of other
    shapes are refused unless ``allow_other_shapes=True`` (the budget was not checked for them).
    """
    problem: Problem = prepare(model, _as_args(example_inputs), kwargs, tuple(shared_inputs))
    planned = plan.info.get("inputs")
    contract = problem.gm.remat_contract
    now = {n: list(sh) for n, sh in zip(contract.names, contract.shapes) if sh is not None}
    if planned is not None and planned != now and not allow_other_shapes:
        raise ValueError(f"this plan was made for inputs {planned}, not {now}: its memory budget was verified for "
                         "those shapes only. Plan again for these inputs, or pass allow_other_shapes=True")
    level = plan.info.get("granularity", "blocks")
    if level not in problem.levels:
        raise ValueError(f"this plan was made for a {level!r} chain, which this model does not have")
    stages = [list(s.nodes) for s in problem.levels[level].chain.stages]
    if stages != [list(s) for s in plan.stages]:
        raise ValueError("this plan was made for a different graph: the model traces to "
                         f"{len(stages)} stages, the plan has {len(plan.stages)} (or their nodes differ)")
    gm = apply_regions(problem, tuple(plan.regions), level)
    gm.remat_plan = plan
    return gm

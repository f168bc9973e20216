"""The public entry points (docs/design.md's contract): profile, checkpoint, checkpoint_, apply_plan."""
from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import torch

from torch import fx

from . import inplace, progress
from .budget import parse_budget
from .errors import public
from .planner import Problem, apply_regions, plan_problem, prepare
from .profiled import as_args, profile
from .solvers.base import Plan
from .solvers.registry import DEFAULT_SLOTS, SolveSettings, get_solver

__all__ = ["profile", "checkpoint", "checkpoint_", "restore_", "apply_plan"]


def _unaliased(args: tuple, kwargs: dict | None) -> tuple[tuple, dict | None]:
    """The example inputs with every tensor that shares memory with an earlier one cloned.

    ``model(ids, labels=ids)`` passes one tensor twice; traced as it is, the graph may read both
    inputs from one of them (torch.export merges aliased inputs), and a later call with two
    different tensors would compute with the wrong one.  Planned with two tensors, it computes
    right either way (the prediction then counts both)."""
    seen: set[tuple[int, int]] = set()

    def fresh(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or value.device.type == "meta":
            return value
        key = (value.untyped_storage().data_ptr(), value.untyped_storage().nbytes())
        if key in seen and value.untyped_storage().nbytes():
            return value.detach().clone().requires_grad_(value.requires_grad)
        seen.add(key)
        return value

    from torch.utils._pytree import tree_map

    return tree_map(fresh, args), (None if kwargs is None else tree_map(fresh, kwargs))


@public
def checkpoint(model: torch.nn.Module, example_inputs: Any = (), kwargs: dict | None = None, *,
               budget: int | float | str | None = None, solver: str = "rotor",
               shared_inputs: tuple[str, ...] = (), slots: int = DEFAULT_SLOTS,
               world_size: int = 1, sharding: str | None = None, calibrate: bool | None = None,
               device: str | torch.device | None = None) -> fx.GraphModule:
    """A GraphModule that trains like ``model`` within ``budget``, recomputing what it must.

    ``budget``: bytes (int), a size ("1.5GiB", "800MB"), or a fraction in (0, 1] of what
    checkpointing can save (docs/design.md), or "min": the smallest budget at which the solver finds a
    verified plan (rotor and chen-greedy; they default to 0.5).  ``solver``: rotor
    (optimal), chen-greedy, chen-sqrtn, every-stage or none.  The result shares ``model``'s
    parameters and buffers under the same names; ``gm.remat_plan`` is the verified Plan and
    ``gm.code`` shows the checkpoint regions.  Raises InfeasibleBudget when nothing fits.

    ``sharding="fsdp"`` with ``world_size=N`` plans one process of FSDP2 training: the budget is
    per process, parameters and gradients are sharded N ways, and ``example_inputs`` is one
    process's batch.  Wrap the result with ``remat.fully_shard(gm, mesh)``, the layout the
    prediction assumes (src/remat/sharding.py says what it includes).

    ``device="cuda"`` plans for a GPU from a model and inputs on the CPU or meta (no GPU needed):
    the step is simulated with the GPU's kernels and its caching allocator's accounting
    (docs/memory.md).  The returned module has no device in it: move it and its inputs to the GPU.
    """
    if budget is None and get_solver(solver).budgeted:
        budget = 0.5
    parsed = None if budget is None else parse_budget(budget)
    if parsed is not None and parsed.minimum and not get_solver(solver).budgeted:
        raise ValueError(f"budget='min' needs a solver that plans under a budget, not {solver!r}")
    args, kwargs = _unaliased(as_args(example_inputs), kwargs)
    problem = prepare(model, args, kwargs, tuple(shared_inputs),
                      world_size=world_size, sharding=sharding, calibrate=calibrate, device=device)
    with progress.step("plan", f"{solver}, budget {parsed}" if parsed else solver):
        gm, plan = plan_problem(problem, solver, parsed, SolveSettings(slots=slots))
    gm = _agree_across_ranks(problem, gm, plan)
    return gm


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
    if chosen.regions == plan.regions and chosen.info.granularity == plan.info.granularity:
        return gm
    level = chosen.info.granularity
    if level not in problem.levels or [list(s.nodes) for s in problem.levels[level].chain.stages] != chosen.stages:
        raise RuntimeError("rank 0 traced this model to other stages than this process: the processes of one "
                           "job must plan the same model on inputs of the same shapes")
    gm = apply_regions(problem, tuple(chosen.regions), level)
    gm.remat_plan = chosen
    return gm


@public
def checkpoint_(model: torch.nn.Module, example_inputs: Any = None, kwargs: dict | None = None, *,
                budget: int | float | str | None = None, solver: str = "rotor",
                shared_inputs: tuple[str, ...] = (), slots: int = DEFAULT_SLOTS, calibrate: bool | None = None,
                device: str | torch.device | None = None, plan: Plan | None = None) -> torch.nn.Module:
    """Plan ``model`` like ``checkpoint`` and keep the model object: afterwards its own ``forward``
    runs the planned code for training calls like ``model(*example_inputs, **kwargs)`` and its
    original forward for every other call (under ``no_grad``, in ``eval()``, with other keyword
    arguments; src/remat/inplace.py states the rule).  Hugging Face models keep ``generate``,
    ``config``, ``save_pretrained`` and the signature of ``forward`` (the Trainer reads it).
    Returns ``model``; ``model.remat_plan`` is the Plan and ``remat.restore_(model)`` undoes it.

    Without ``example_inputs`` and ``kwargs`` the plan is made at the model's first training call
    (grad enabled, ``model.training``), for that call: whatever loop calls the model (the Trainer,
    accelerate) shows the call to plan for.  ``plan``: a saved Plan (``remat.load_plan``) applied
    without solving, e.g. one made on a meta-device copy of the model (``apply_plan``)."""
    if inplace.is_attached(model):
        inplace.detach(model)

    def make(target: torch.nn.Module, args: tuple, call_kwargs: dict | None) -> fx.GraphModule:
        if plan is not None:
            return apply_plan(target, args, plan, call_kwargs, shared_inputs=shared_inputs)
        return checkpoint(target, args, call_kwargs, budget=budget, solver=solver, shared_inputs=shared_inputs,
                          slots=slots, calibrate=calibrate, device=device)

    if example_inputs is None and kwargs is None:
        def at_first_call(target: torch.nn.Module, args: tuple, call_kwargs: dict) -> fx.GraphModule:
            with progress.step("plan at the first training call", _describe_call(args, call_kwargs)):
                return make(target, args, call_kwargs)

        return inplace.attach_pending(model, at_first_call)
    args = as_args(() if example_inputs is None else example_inputs)
    return inplace.attach(model, make(model, args, kwargs), args, kwargs or {})


def _describe_call(args: tuple, kwargs: dict) -> str:
    def one(v: Any) -> str:
        return f"{tuple(v.shape)} {str(v.dtype)[6:]}" if isinstance(v, torch.Tensor) else type(v).__name__
    return ", ".join([one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()])


def _shape_of(stages: list[list[str]]) -> list[list[str]]:
    """Stages as node kinds: names without fx's counters (``sym_size_int_11`` and ``sym_size_int_9``
    are one node of two traces whose shape symbols were numbered in another order: a model traced
    on meta and materialized)."""
    return [[re.sub(r"_\d+$", "", name) for name in stage] for stage in stages]


def restore_(model: torch.nn.Module) -> torch.nn.Module:
    """Undo ``checkpoint_``: ``model.forward`` is the model's own again.  Returns ``model``."""
    return inplace.detach(model)


@public
def apply_plan(model: torch.nn.Module, example_inputs: Any, plan: Plan, kwargs: dict | None = None, *,
               shared_inputs: tuple[str, ...] = (), allow_other_shapes: bool = False) -> fx.GraphModule:
    """Re-apply a saved plan without solving; the model must trace to the same stages.

    A plan holds for the input shapes it was made for (``plan.info["inputs"]``): inputs of other
    shapes are refused unless ``allow_other_shapes=True`` (the budget was not checked for them).
    """
    args, kwargs = _unaliased(as_args(example_inputs), kwargs)
    problem: Problem = prepare(model, args, kwargs, tuple(shared_inputs))
    planned = plan.info.inputs or None
    contract = problem.gm.remat_contract
    now = {n: list(sh) for n, sh in zip(contract.names, contract.shapes) if sh is not None}
    if planned is not None and planned != now and not allow_other_shapes:
        raise ValueError(f"this plan was made for inputs {planned}, not {now}: its memory budget was verified for "
                         "those shapes only. Plan again for these inputs, or pass allow_other_shapes=True")
    level = plan.info.granularity
    if level not in problem.levels:
        raise ValueError(f"this plan was made for a {level!r} chain, which this model does not have")
    stages = [list(s.nodes) for s in problem.levels[level].chain.stages]
    if _shape_of(stages) != _shape_of(plan.stages):
        raise ValueError("this plan was made for a different graph: the model traces to "
                         f"{len(stages)} stages, the plan has {len(plan.stages)} (or their nodes differ)")
    gm = apply_regions(problem, tuple(plan.regions), level)
    plan = replace(plan, stages=stages)  # the same graph; fx may number its nodes otherwise
    gm.remat_plan = plan
    return gm

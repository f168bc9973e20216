"""The pipeline's first stages for one model: trace it, check the trace, profile one training step
for the device the plan is for.  ``remat.profile`` stops here; the planner starts from it
(planner/problem.py), so profiling needs no solver, sharding or search."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.utils._pytree import tree_leaves

from . import progress
from .codegen import NodeRegion, build
from .errors import public
from .fake import target_device
from .inputs import contract, user_regions
from .profiler.calibrate import calibration_for
from .profiler.dispatch import ScratchSource, Target
from .profiler.model import ModelProfile, profile_graph
from .profiler.step import simulate_step
from .trace import trace

__all__ = ["Profiled", "as_args", "profile", "resolve_device", "state_and_inputs", "trace_and_profile"]


@dataclass
class Profiled:
    """A traced and profiled model: the trace (the model's checkpoint calls inlined), the module
    that runs the step as the model does (``baseline``), and where kernel scratch came from."""

    gm: fx.GraphModule
    profile: ModelProfile  # peak_bytes: the baseline's; inlined_peak_bytes: the trace's
    baseline: fx.GraphModule
    user_regions: tuple[NodeRegion, ...]
    target: Target
    scratch: ScratchSource | None


def resolve_device(device: str | torch.device | None, tensors: list[torch.Tensor]) -> torch.device:
    """The device a plan is for: ``device`` ("cpu", "cuda", "cuda:1"), or where the model's tensors
    are (the CPU for meta tensors)."""
    if device is None:
        return target_device(tensors)
    found = torch.device(device)
    if found.type not in ("cpu", "cuda"):
        raise ValueError(f"remat plans for device 'cpu' or 'cuda', not {str(device)!r}")
    if found.type == "cuda" and found.index is None:
        found = torch.device("cuda", 0)
    return found


def trace_and_profile(model: torch.nn.Module, args: tuple, kwargs: dict | None = None,
                      calibrate: bool | None = None, check: bool = True,
                      device: str | torch.device | None = None) -> Profiled:
    """Trace ``model`` and profile one step of the trace for ``device`` (default: the device its
    tensors are on); with the model's own checkpoint calls, the step's peak is the one with them
    in place."""
    with progress.step("trace and check" if check else "trace"):
        gm = trace(model, args, kwargs, check=check)
    tensors = state_and_inputs(model, args, kwargs)
    target = Target(resolve_device(device, tensors))
    scratch = calibration_for(target, tensors, calibrate)
    with progress.step("profile"):
        prof = profile_graph(gm, args, kwargs, target, scratch)
    gm.remat_contract = contract(gm, target.threads)
    regions = user_regions(gm)
    baseline = build(gm, regions)
    if regions:
        prof.peak_bytes = simulate_step(baseline, args, kwargs, target=target, scratch=scratch).peak
    if scratch is not None:
        scratch.flush()
    return Profiled(gm, prof, baseline, regions, target, scratch)


def state_and_inputs(model: torch.nn.Module, args: tuple, kwargs: dict | None = None) -> list[torch.Tensor]:
    """The model's parameters and buffers and every tensor in its inputs: what says where a step
    runs and whether its kernels can be measured here."""
    return [t for t in (*model.parameters(), *model.buffers(), *tree_leaves((args, kwargs)))
            if isinstance(t, torch.Tensor)]


def as_args(example_inputs: Any) -> tuple:
    """The example inputs as positional arguments: a tuple or list of them, or one input alone."""
    return tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)


@public
def profile(model: torch.nn.Module, example_inputs: Any = (), kwargs: dict | None = None, *,
            calibrate: bool | None = None, device: str | torch.device | None = None) -> ModelProfile:
    """Predict FLOPs, per-node memory and the peak of one training step, on fake tensors.

    The model is traced (it is not modified) and its step simulated without allocating real
    memory: ``example_inputs`` may live on the meta device.  Kernel scratch is measured op by op
    on this machine when the inputs are real CPU tensors (``calibrate=None``; True/False force it),
    else bounded by the memory rules.  ``device="cuda"`` predicts the step on a GPU (its kernels,
    its allocator's accounting) for a model and inputs on the CPU or meta; default: where they are.

    The step predicted is the traced one, which frees each value after its last use, as every
    module remat generates does; Python code that keeps intermediates in locals until its function
    returns (``nn.MultiheadAttention`` with ``need_weights``) can peak a little higher run eagerly.
    """
    return trace_and_profile(model, as_args(example_inputs), kwargs, calibrate, device=device).profile

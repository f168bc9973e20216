"""The public entry points (DESIGN.md's contract): profile, count_flops, measure_peak, checkpoint."""
from __future__ import annotations

from typing import Any

import torch

from torch import fx

from .chain import linearize
from .codegen import generate
from .profiler.model import ModelProfile, profile_graph
from .solvers.base import Plan, Region
from .solvers.chen import sqrtn_regions
from .trace import trace

__all__ = ["profile", "checkpoint"]

SOLVERS = ("none", "chen-sqrtn", "every-stage")


def _as_args(example_inputs: Any) -> tuple:
    return tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)


def profile(model: torch.nn.Module, example_inputs: Any = (), kwargs: dict | None = None) -> ModelProfile:
    """Predict FLOPs, per-node memory and the peak of one training step, on fake tensors.

    The model is traced (it is not modified) and its step simulated without allocating real
    memory: ``example_inputs`` may live on the meta device.
    """
    args = _as_args(example_inputs)
    gm = trace(model, args, kwargs)
    return profile_graph(gm, args, kwargs)


def checkpoint(model: torch.nn.Module, example_inputs: Any = (), kwargs: dict | None = None, *,
               solver: str = "chen-sqrtn", shared_inputs: tuple[str, ...] = ()) -> fx.GraphModule:
    """A GraphModule that trains like ``model`` with stages recomputed under ``torch.utils.checkpoint``.

    The returned module shares ``model``'s parameters and buffers (same names); ``gm.remat_plan``
    describes what was checkpointed and ``gm.code`` shows it.
    """
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")
    args = _as_args(example_inputs)
    gm = trace(model, args, kwargs)
    prof = profile_graph(gm, args, kwargs)
    chain = linearize(gm, shared_inputs)
    if solver == "none":
        regions: tuple[Region, ...] = ()
    elif solver == "every-stage":
        regions = tuple(Region(i, i + 1) for i in range(len(chain)))
    else:
        regions = sqrtn_regions(chain)
    out = generate(gm, chain, regions) if regions else gm
    out.remat_plan = Plan(
        solver=solver, budget_bytes=None, predicted_peak_bytes=prof.peak_bytes if not regions else 0,
        recompute_flops=sum(chain.stages[i].fwd_flops for r in regions for i in range(r.start, r.stop)),
        stages=[list(s.nodes) for s in chain.stages], regions=regions,
        step_flops=prof.fwd_flops + prof.bwd_flops,
    )
    return out

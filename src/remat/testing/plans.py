"""Hand-made plans the tests and benchmarks share."""
from __future__ import annotations

from dataclasses import replace

import torch

__all__ = ["keeping_everywhere"]


def keeping_everywhere(model: torch.nn.Module, inputs: tuple, kwargs: dict | None = None) -> torch.nn.Module:
    """``model`` with every stage its own region, each keeping its matmul/conv/attention outputs
    unless the profile refuses it (a later op writes one in place): the most selective
    checkpointing remat allows, whatever its op times would choose."""
    import remat
    from remat.solvers.base import FULL, SAVE_COMPUTE, Region

    plan = remat.checkpoint(model, inputs, kwargs, budget=1.0).remat_plan
    refused = {stage for stage, _ in plan.info.keep_refused}
    regions = tuple(Region(i, i + 1, (), FULL if i in refused else SAVE_COMPUTE) for i in range(len(plan.stages)))
    return remat.apply_plan(model, inputs, replace(plan, regions=regions), kwargs)

"""The public entry points (DESIGN.md's contract): profile, count_flops, measure_peak, checkpoint."""
from __future__ import annotations

from typing import Any

import torch

from .profiler.model import ModelProfile, profile_graph
from .trace import trace

__all__ = ["profile"]


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

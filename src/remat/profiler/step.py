"""Whole-step simulation: run docs/design.md's training step on fake tensors and follow every storage.

The prediction is the peak of the simulated allocator (``StorageTracker``) plus the resident bytes,
the same definition ``measure_peak`` measures on a real run.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from ..step import run_step
from .dispatch import ScratchSource, Simulation, Target
from .memory import storage_bytes

__all__ = ["StepMemory", "simulate_step"]


@dataclass(frozen=True)
class StepMemory:
    """Predicted memory of one training step, in bytes."""

    resident: int  # parameters, buffers and inputs, alive before the step (and library workspaces)
    peak_above: int  # highest simulated allocation above the resident bytes
    grad_bytes: int  # gradients alive at the end of the step

    @property
    def peak(self) -> int:
        return self.resident + self.peak_above


@contextmanager
def _sharded_gradients(state: dict[str, torch.Tensor], grad_shards: dict[str, int]) -> Iterator[list]:
    """FSDP2 reduce-scatters a unit's gradients once its backward is done: replace each listed
    parameter's gradient by a shard of the given bytes the moment it is accumulated."""
    kept: list[torch.Tensor] = []
    handles = []
    for name, nbytes in grad_shards.items():
        def hook(p: torch.Tensor, nbytes: int = nbytes) -> None:
            kept.append(torch.empty(nbytes, dtype=torch.uint8, device=p.device))
            p.grad = None
        handles.append(state[name].register_post_accumulate_grad_hook(hook))
    try:
        yield kept
    finally:
        for h in handles:
            h.remove()


def simulate_step(fn: Callable[..., Any], args: tuple, kwargs: dict | None = None,
                  grad_shards: dict[str, int] | None = None, target: Target | None = None,
                  scratch: ScratchSource | None = None) -> StepMemory:
    """Predict the peak of one training step of ``fn`` (a module, or a callable using one).

    ``grad_shards`` (parameter name -> bytes): gradients replaced by shards as they are accumulated
    (sharding.py); the resident bytes stay those of the unsharded module.
    """
    sim = Simulation(fn, tuple(args), kwargs, target, scratch)
    resident_tensors = [*sim.state.values(), *sim.inputs]
    with sim.running(), _sharded_gradients(sim.state, grad_shards or {}) as shards:
        run_step(lambda: fn(*sim.args, **sim.kwargs))
    grads = [t.grad for t in sim.state.values() if t.grad is not None]
    held = sim.target.allocated  # the device allocator's count of each storage
    grad_bytes = storage_bytes(grads, held) + storage_bytes(shards, held)
    return StepMemory(storage_bytes(resident_tensors, held) + sim.target.workspace, sim.tracker.peak, grad_bytes)

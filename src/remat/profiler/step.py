"""Whole-step simulation: run DESIGN.md's training step on fake tensors and follow every storage.

The prediction is the peak of the simulated allocator (``StorageTracker``) plus the resident bytes,
the same definition ``measure_peak`` measures on a real run.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..fake import FakeSession, module_of
from ..step import loss_of, reparametrized
from .eager import EagerComposites, eager_layout
from .memory import StorageTracker, real_outputs, saved_scalar_bytes, storage_bytes, storages_of
from .workspace import workspace_bytes

__all__ = ["StepMemory", "MemoryMode", "simulate_step"]


@dataclass(frozen=True)
class StepMemory:
    """Predicted memory of one training step, in bytes."""

    resident: int  # parameters, buffers and inputs, alive before the step
    peak_above: int  # highest simulated allocation above the resident bytes
    grad_bytes: int  # gradients alive at the end of the step

    @property
    def peak(self) -> int:
        return self.resident + self.peak_above


class MemoryMode(TorchDispatchMode):
    """Registers every op's new output storages and its backend workspace with a tracker."""

    def __init__(self, tracker: StorageTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = eager_layout(func, args, func(*args, **kwargs))
        self.tracker.allocate(storages_of(real_outputs(func, args, out)))
        self.tracker.hold(saved_scalar_bytes(func, args))
        self.tracker.transient(workspace_bytes(func, args, kwargs, out))
        return out


@contextmanager
def _tracked_rng_state(tracker: StorageTracker) -> Iterator[None]:
    """torch.utils.checkpoint stashes the CPU RNG state (a real 5 KB tensor, made outside any op)
    for every region that preserves it; count those like any other storage."""
    original = torch.get_rng_state

    def get_rng_state() -> torch.Tensor:
        state = original()
        tracker.allocate([state.untyped_storage()])
        return state

    torch.get_rng_state = get_rng_state
    try:
        yield
    finally:
        torch.get_rng_state = original


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
                  grad_shards: dict[str, int] | None = None) -> StepMemory:
    """Predict the peak of one training step of ``fn`` (a module, or a callable using one).

    ``grad_shards`` (parameter name -> bytes): gradients replaced by shards as they are accumulated
    (sharding.py); the resident bytes stay those of the unsharded module.
    """
    module = module_of(fn)
    session = FakeSession.for_call(module, args, kwargs)
    state = session.state(module) if module is not None else {}
    fargs, fkwargs = session.tree(tuple(args)), session.tree(kwargs or {})
    flat, _ = tree_flatten((fargs, fkwargs))
    resident_tensors = [*state.values(), *(t for t in flat if isinstance(t, torch.Tensor))]
    tracker = StorageTracker()
    tracker.mark_resident(resident_tensors)
    with session.mode, reparametrized(module, state), _tracked_rng_state(tracker), EagerComposites():
        with MemoryMode(tracker), _sharded_gradients(state, grad_shards or {}) as shards:
            loss = loss_of(fn(*fargs, **fkwargs))
            if loss is not None:
                loss.backward()
            del loss
        grads = [t.grad for t in state.values() if t.grad is not None]
        grad_bytes = storage_bytes(grads) + storage_bytes(shards)
    return StepMemory(storage_bytes(resident_tensors), tracker.peak, grad_bytes)


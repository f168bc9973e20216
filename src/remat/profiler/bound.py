"""The least memory any checkpointing of a step can need: the bound a floor is judged by.

Recomputation changes when forward ops run and what is kept between them, never which ops run or
which tensors each of them reads and writes at once.  So no plan of the same model code (remat's,
checkpoints placed by hand, torch's selective checkpointing) goes below the larger of:

* the end of the step: resident bytes (parameters, buffers, inputs) and every parameter gradient;
* any one op of the step: resident bytes, the storages it reads and writes and its kernel scratch;
  in the backward also the loss, and what the earlier ops of the same autograd node made and
  still hold (a node returns all its gradients at once: AddmmBackward's input and weight
  gradients are both alive when it ends).

A budget under this bound needs another remedy (a smaller batch, lower precision, sharding,
offloading, other model code), not a better plan.  ``OpBound`` watches the profile's own fake step
(the same kernel scratch as every prediction); the bound is weak by design: it leaves out whatever
an op finds alive that depends on the schedule.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..units import fmt_bytes
from .memory import StorageTracker, tensors_in

__all__ = ["Bound", "OpBound", "checkpointing_bound"]


@dataclass(frozen=True)
class Bound:
    """A lower bound on the peak of any checkpointing plan, and what sets it."""

    bytes: int
    reason: str  # for people: what needs that much at once

    def __str__(self) -> str:
        return f"{fmt_bytes(self.bytes)}: {self.reason}"


class OpBound:
    """Observer of a fake step: the most one op holds at once (see the module docstring)."""

    def __init__(self, tracker: StorageTracker) -> None:
        self.tracker = tracker
        self.phase = "forward"
        self.held: list[torch.Tensor] = []  # alive through the whole backward: the loss
        self.most = 0  # bytes above the resident ones
        self.op = ""
        self._node: object = None  # the autograd node running (backward)
        self._made: set[int] = set()  # storage keys its earlier ops made

    def backward(self, loss: torch.Tensor) -> None:
        """Called between the forward and the backward: from now on ``loss`` is held."""
        self.phase, self.held = "backward", [loss]

    def finish(self) -> None:
        """After the backward: let go of the loss and of the last autograd node."""
        self.held, self._node, self._made = [], None, set()

    def observe(self, func: Any, args: tuple, kwargs: dict, out: Any, as_is: bool = True, kernel: Any = None) -> None:
        if not as_is:  # a composite: its parts are observed one by one
            return
        made = _storage_keys(out)
        keys = _storage_keys((args, tuple(kwargs.values()), self.held)) | made
        if self.phase == "backward":
            node = torch._C._current_autograd_node()
            if node is not self._node:
                self._node, self._made = node, set()
            self._made |= made
            keys |= self._made
        need = sum(self.tracker.live_bytes(k) for k in keys) + (kernel.scratch if kernel is not None else 0)
        if need > self.most:
            self.most, self.op = need, f"{func} in the {self.phase}"


def _key(t: torch.Tensor) -> int | None:
    try:
        return id(t.untyped_storage())
    except (RuntimeError, NotImplementedError):  # sparse, nested: no single storage; not tracked either
        return None


def _storage_keys(values: Any) -> set[int]:
    """Storage keys of the tensors in an op's arguments or outputs."""
    return {k for k in map(_key, tensors_in(values)) if k is not None}


def checkpointing_bound(resident: int, fixed: int, op_bytes: int, op: str) -> Bound:
    """The bound from a profile's numbers: ``fixed`` (resident + gradients) or one op's need."""
    if fixed >= resident + op_bytes:
        return Bound(fixed, "parameters, buffers, inputs and every parameter gradient, at the end of the step")
    return Bound(resident + op_bytes, f"resident bytes plus what one {op} reads, writes and allocates at once")

"""Composite ops whose eager path fake tensors do not take.

Some CompositeImplicit ops branch on ``isTensorSubclassLike``: a fake tensor is subclass-like, so
on fake tensors they take an out-of-place path a real run does not.  The simulation runs under
``EagerComposites`` so it allocates what eager allocates.

* ``F.linear`` with a bias on an input that is neither 2-D nor contiguous (a transposed sequence,
  a permuted image): eager computes ``matmul`` and adds the bias in place; on fake tensors the add
  is out of place, one output-sized buffer more.  Eager too is subclass-like while a Python
  dispatch mode runs (torch's selective checkpoint, remat's state freezing): then it adds out of
  place as well.  The simulation's own modes (fake tensors, accounting) are not counted: they are
  registered with ``own_modes`` once they are on.

The backward must run with the mode still on (``remat.step.backward``): a checkpoint recomputes its region
there, and must take the paths its forward took (selective checkpointing checks that it does).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

__all__ = ["EagerComposites"]


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Any:
    fused = x.dim() == 2 or x.is_contiguous()  # addmm / _flatten_nd_linear: the same on fake tensors
    if bias is None or fused or torch.is_autocast_enabled(x.device.type):
        return None
    return torch.matmul(x, weight.t()).add_(bias)


class EagerComposites(TorchFunctionMode):
    """Routes the composites above through the ops eager runs."""

    def __init__(self) -> None:
        super().__init__()
        self.own: set[int] = set()

    def own_modes(self) -> None:
        """The dispatch modes now on are the simulation's: a real run has none of them."""
        self.own = {id(m) for m in _get_current_dispatch_mode_stack()}

    def _eager_subclass_like(self) -> bool:
        return any(id(m) not in self.own for m in _get_current_dispatch_mode_stack())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func is F.linear and all(isinstance(a, torch.Tensor) or a is None for a in (*args, *kwargs.values()))
                and not self._eager_subclass_like()):
            out = _linear(*args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)

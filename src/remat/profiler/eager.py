"""Eager-mode paths of composite ops that fake tensors would otherwise take differently.

Some CompositeImplicit ops branch on ``isTensorSubclassLike``: a fake tensor is subclass-like, so
on fake tensors they take an out-of-place path a real run does not.  The memory simulation runs
under ``EagerComposites`` so it allocates what eager allocates.

* ``F.linear`` with a bias on an input that is neither 2-D nor contiguous (a transposed sequence,
  a permuted image): eager computes ``matmul`` and adds the bias in place; on fake tensors the add
  is out of place, one output-sized buffer more.

Some fake kernels also lay their outputs out differently from the CPU kernels, and the layout
decides what later kernels copy (a channels-last convolution converts a contiguous operand).
``eager_layout`` gives those outputs eager's strides:

* ``native_group_norm`` (and its backward) keep a channels-last input's layout.
* ``native_layer_norm_backward`` returns a contiguous input gradient for a strided input.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .workspace import _channels_last

__all__ = ["EagerComposites", "eager_layout"]

aten = torch.ops.aten


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Any:
    fused = x.dim() == 2 or x.is_contiguous()  # addmm / _flatten_nd_linear: the same on fake tensors
    if bias is None or fused or torch.is_autocast_enabled(x.device.type):
        return None
    return torch.matmul(x, weight.t()).add_(bias)


class EagerComposites(TorchFunctionMode):
    """Routes the composites above through the ops eager runs."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and all(isinstance(a, torch.Tensor) or a is None for a in (*args, *kwargs.values())):
            out = _linear(*args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


def eager_layout(func: Any, args: tuple, out: Any) -> Any:
    """``out`` with the strides the CPU kernel would give it (called inside a dispatch mode, so
    the replacement is made by the fake mode below: no data)."""
    if func is aten.native_layer_norm_backward.default:
        first = out[0]
        if first is None or first.device.type != "cpu" or first.is_contiguous():
            return out
        return (torch.empty_like(first, memory_format=torch.contiguous_format), *out[1:])
    if func is aten.native_group_norm.default:
        x = args[0]
    elif func is aten.native_group_norm_backward.default:
        x = args[1]
    else:
        return out
    if x.device.type != "cpu" or not _channels_last(x) or out[0] is None or _channels_last(out[0]):
        return out
    return (torch.empty_like(out[0], memory_format=torch.channels_last), *out[1:])

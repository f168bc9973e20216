"""The training step that every count, prediction and measurement in remat refers to (docs/design.md).

``out = model(*inputs)``, ``loss = sum of .float().sum() over the floating-point tensors in out``,
``loss.backward()``.  Outputs may be tensors, tuples, lists, dicts (HF ``ModelOutput`` included),
dataclasses or named tuples.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["floating_outputs", "loss_of", "reparametrized"]


def floating_outputs(out: Any) -> Iterator[torch.Tensor]:
    """Every floating-point tensor inside ``out``, in a deterministic order."""
    if isinstance(out, torch.Tensor):
        if out.is_floating_point() or out.is_complex():
            yield out
    elif isinstance(out, dict):
        for value in out.values():
            yield from floating_outputs(value)
    elif isinstance(out, (tuple, list)):
        for value in out:
            yield from floating_outputs(value)
    elif dataclasses.is_dataclass(out) and not isinstance(out, type):
        for f in dataclasses.fields(out):
            yield from floating_outputs(getattr(out, f.name))


def loss_of(out: Any) -> torch.Tensor | None:
    """The step's loss, or None when no output can carry a gradient."""
    parts = [t.float().sum() if not t.is_complex() else t.real.float().sum()
             for t in floating_outputs(out) if t.requires_grad]
    if not parts:
        return None
    loss = parts[0]
    for p in parts[1:]:
        loss = loss + p
    return loss


@contextmanager
def reparametrized(module: torch.nn.Module | None, state: dict[str, torch.Tensor]) -> Iterator[None]:
    """Temporarily run ``module`` with ``state`` in place of its parameters and buffers.

    The same mechanism as ``torch.func.functional_call``, but usable around any callable that
    uses the module (a bound method, a closure); the module is restored on exit.
    """
    if module is None or not state:
        yield
        return
    from torch.nn.utils.stateless import _reparametrize_module

    with _reparametrize_module(module, state, tie_weights=True, strict=False):
        yield

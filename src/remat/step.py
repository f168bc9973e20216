"""The training step that every count, prediction and measurement in remat refers to (docs/design.md).

``out = model(*inputs)``, ``loss = sum of .float().sum() over the floating-point tensors in out``,
``loss.backward()``.  Outputs may be tensors, tuples, lists, dicts (HF ``ModelOutput`` included),
dataclasses or named tuples.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["BWD", "FWD", "LOSS", "backward", "floating_outputs", "graph_leaves", "loss_of", "reparametrized",
           "run_step"]

# The phases of the step, as observers attribute ops to them (run_step tells them when each begins)
FWD, LOSS, BWD = "fwd", "loss", "bwd"


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


def run_step(forward: Callable[[], Any], on_phase: Callable[[str, Any], None] | None = None, *,
             accumulate: bool = True) -> None:
    """The training step every count and prediction observes, written once: ``forward()`` (the
    caller's fake call, inside its modes), the loss of its output, the loss's backward.
    ``on_phase(name, loss)`` is told as the loss (LOSS, None) and the backward (BWD, the loss;
    None when nothing needs a gradient) begin, so observers attribute ops to them.
    ``accumulate=False``: the backward writes no ``.grad`` (``torch.autograd.grad`` to the graph's
    leaves: the same ops)."""
    out = forward()
    if on_phase is not None:
        on_phase(LOSS, None)
    loss = loss_of(out)
    del out  # only the loss's graph holds the output's storages from here
    if on_phase is not None:
        on_phase(BWD, loss)
    if loss is None:
        return
    if accumulate:
        backward(loss)
    else:
        torch.autograd.grad(loss, graph_leaves(loss), allow_unused=True)


def backward(loss: torch.Tensor) -> None:
    """``loss.backward()`` for a scalar loss, with the torch-function modes left on.

    ``Tensor.backward`` is itself a torch function: a mode handles the call and is off while the
    autograd engine runs, so checkpoint recomputations would run without ``EagerComposites`` and
    take the fake path their forward did not.  Calling the engine directly keeps the mode stack.
    """
    from torch.autograd.graph import _engine_run_backward

    grad = torch.ones_like(loss, memory_format=torch.preserve_format)  # what Tensor.backward makes
    _engine_run_backward((loss,), (grad,), False, False, (), allow_unreachable=True, accumulate_grad=True)


def graph_leaves(root: torch.Tensor) -> list[torch.Tensor]:
    """Every leaf tensor that requires grad in the autograd graph of ``root``."""
    leaves: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    stack = [root.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            leaves.setdefault(id(variable), variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return list(leaves.values())

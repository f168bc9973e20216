"""One training step of a module, and the comparison every codegen/solver test makes."""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch

from ..step import floating_outputs, loss_of

if TYPE_CHECKING:
    from ..margin import Margin


def train_step(module: torch.nn.Module, inputs: tuple, seed: int = 0, kwargs: dict | None = None):
    """Outputs, gradients by name and buffers by name after one step from .grad = None."""
    for p in module.parameters():
        p.grad = None
    torch.manual_seed(seed)
    out = module(*inputs, **(kwargs or {}))
    loss = loss_of(out)
    if loss is not None:  # no output depends on a parameter or an input that requires grad
        loss.backward()
    outs = [t.detach().clone() for t in floating_outputs(out)]
    grads = {k: p.grad.clone() for k, p in module.named_parameters() if p.grad is not None}
    buffers = {k: b.clone() for k, b in module.named_buffers()}
    return outs, grads, buffers


def _close(got: torch.Tensor, ref: torch.Tensor, scale: float | None, what: str) -> None:
    if scale is None or not ref.is_floating_point():
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5, msg=lambda m: f"{what}: {m}")
        return
    # float sums reordered (a torch.export trace calls other kernels for some ops): each element
    # within ``scale`` of the tensor's largest magnitude
    atol = scale * max(float(ref.detach().abs().max()) if ref.numel() else 0.0, 1e-3)
    torch.testing.assert_close(got, ref, atol=atol, rtol=0.0, msg=lambda m: f"{what}: {m}")


def assert_same_step(original: torch.nn.Module, make_new, inputs: tuple, seed: int = 0, kwargs: dict | None = None,
                     scale: float | None = None):
    """The module ``make_new(model_copy)`` trains exactly like ``original`` (outputs, grads, buffers).
    ``scale``: compare each tensor to within that share of its largest magnitude instead (the
    trace check's tolerance for float32 sums in another order; 1e-5)."""
    twin = copy.deepcopy(original)
    new = make_new(twin)
    ref = train_step(original, inputs, seed, kwargs)
    got = train_step(new, inputs, seed, kwargs)
    for a, b in zip(ref[0], got[0], strict=True):
        _close(b, a, scale, "output")
    assert ref[1].keys() == got[1].keys()
    for k in ref[1]:
        _close(got[1][k], ref[1][k], scale, f"grad {k}")
    assert ref[2].keys() == got[2].keys()
    for k in ref[2]:
        _close(got[2][k], ref[2][k], scale, f"buffer {k}")
    return new


def assert_predicted(predicted: int, measured: int, margin: "Margin | None" = None, what: object = "") -> None:
    """A measured peak within the margin plans are verified with (remat/margin.py): never more than
    its allowance above the prediction, and at most its over-prediction share below."""
    from ..margin import MEASURED

    margin = margin or MEASURED
    assert measured <= predicted + margin.allowance(predicted), (
        f"{what}: measured {measured} B is {measured - predicted} B above the prediction {predicted} B, more "
        f"than the {margin.allowance(predicted)} B margin ({margin.source})")
    assert predicted <= measured * (1 + margin.over_share), (
        f"{what}: predicted {predicted} B is over the measured {measured} B by more than {margin.over_share:.1%}")

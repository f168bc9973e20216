"""A GPU step simulated on a machine without one: fake CPU tensors stand in for fake CUDA tensors.

Fake CUDA tensors can be made without a GPU, but their step cannot run there: autograd's engine
asks the CUDA driver about device 0 as soon as a backward touches a CUDA node
(``GraphTask::stash_current_streams`` -> ``hasPrimaryContext``: "expects a valid device index",
pytorch/pytorch#92627), and dispatch on a fake CUDA tensor without a GPU chooses the math attention
(``_fused_sdp_choice`` cannot read the device's properties), not the kernels a GPU runs.  So when
the target is CUDA and no GPU is usable, the step runs on fake CPU tensors and:

* the memory rules and the allocator's granularity are those of the target (``dispatch.py`` maps the
  stand-in's device type to the target's);
* ``scaled_dot_product_attention`` calls the kernel a GPU would choose (``cuda_sdpa_backend``): what
  it saves for backward is that kernel's (a logsumexp, not the attention matrix);
* ``torch.autocast("cuda", ...)`` regions run as CPU autocast with the same dtype (the op lists of the
  two differ in detail; matmuls, convolutions and attention are cast by both).

With a GPU present the step runs on fake CUDA tensors and none of this applies.
"""
from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["fake_device_for", "cuda_sdpa_backend", "CudaStandIn", "stand_in"]


def fake_device_for(device: torch.device) -> torch.device:
    """Where the fake tensors of a step on ``device`` live on this machine: the device itself when
    this machine can simulate it, else the CPU (the stand-in).  ``REMAT_STANDIN=1`` forces the
    stand-in with a GPU present (benchmarks/cuda.py checks what a machine without one predicts)."""
    if device.type == "cuda" and (not torch.cuda.is_available() or os.environ.get("REMAT_STANDIN") == "1"):
        return torch.device("cpu")
    if device.type == "meta":
        return torch.device("cpu")
    return device


@functools.cache
def init_cuda_context(device: torch.device) -> None:
    """A backward on fake CUDA tensors needs a real CUDA context (pytorch/pytorch#92627; torch's own
    warm-up in fake_tensor.init_gpu_context compares a device with a string and never runs,
    pytorch/pytorch#196338): allocate one real byte on the GPU once."""
    torch.empty(1, device=device)


def cuda_sdpa_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None,
                      enable_gqa: bool = False) -> str:
    """The attention kernel torch picks on a recent GPU (sm80+), after
    aten/src/ATen/native/transformers/cuda/sdp_utils.cpp ``select_sdp_backend``: flash first (fp16/bf16,
    no mask, head dim at most 256 and a multiple of 8), then memory-efficient (fp32 too, masks
    allowed), then math; the ``torch.backends.cuda.*_sdp_enabled()`` switches are honoured."""
    dims = {q.shape[-1], k.shape[-1]}
    shapes_ok = q.dim() == 4 and k.dim() == 4 and v.dim() == 4 and not enable_gqa and q.shape[1] == k.shape[1]
    if (shapes_ok and torch.backends.cuda.flash_sdp_enabled() and q.dtype in (torch.float16, torch.bfloat16)
            and attn_mask is None and max(dims) <= 256 and all(d % 8 == 0 for d in dims)
            and q.shape[-1] == v.shape[-1]):
        return "flash"
    align = 4 if q.dtype == torch.float32 else 8
    if (shapes_ok and torch.backends.cuda.mem_efficient_sdp_enabled()
            and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and all(d % align == 0 for d in dims) and v.shape[-1] % align == 0):
        return "efficient"
    return "math"


def _float_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as the additive float bias the fused kernels take (sdp_utils'
    ``convert_boolean_attn_mask``: True keeps, False is -inf)."""
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask.logical_not(), float("-inf"))


def _sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None, dropout_p: float = 0.0,
          is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor | None:
    backend = cuda_sdpa_backend(query, key, value, attn_mask, enable_gqa)
    if backend == "flash":
        return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False,
                                                                  scale=scale)[0]
    if backend == "efficient":
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        mask = None if attn_mask is None else _float_mask(attn_mask, query.dtype)
        return torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, mask, grad, dropout_p,
                                                                      is_causal, scale=scale)[0]
    return None


class CudaStandIn(TorchFunctionMode):
    """Routes ``F.scaled_dot_product_attention`` to the fused kernel a GPU would run."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            out = _sdpa(*args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


@contextmanager
def _cuda_autocast_on_cpu() -> Iterator[None]:
    """``torch.autocast("cuda", dtype=...)`` entered as ``torch.autocast("cpu", dtype=...)``."""
    from torch.amp.autocast_mode import autocast

    original = autocast.__init__

    def init(self: Any, device_type: str, *args: Any, **kwargs: Any) -> None:
        original(self, "cpu" if device_type == "cuda" else device_type, *args, **kwargs)

    autocast.__init__ = init
    try:
        yield
    finally:
        autocast.__init__ = original


@contextmanager
def stand_in(target_device: torch.device) -> Iterator[None]:
    """The CPU standing in for ``target_device`` (a GPU this machine lacks) while a step runs."""
    if target_device.type != "cuda":
        yield
        return
    with _cuda_autocast_on_cpu(), CudaStandIn():
        yield

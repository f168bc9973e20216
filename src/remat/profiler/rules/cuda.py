"""CUDA rules: what ``torch.cuda.max_memory_allocated`` counts that fake outputs do not show.

None of these numbers was measured on a GPU (none was available when they were written): each is
derived from torch's source, cited in its ``source``, and meant as an upper bound.
``benchmarks/cuda.py`` measures the predictions they give on a real GPU.

What needs no rule here:

* Which tensors the CUDA kernels save for backward (flash and memory-efficient attention keep a
  logsumexp instead of the attention matrix, cuDNN batch norm its mean and inverse std): these are
  the kernels' own outputs, so they come from dispatch.  Without a GPU, dispatch cannot pick the
  kernels a GPU would (``profiler/standin.py`` routes attention to them).
* The RNG state ``torch.utils.checkpoint`` stashes per region (``preserve_rng_state``): on CUDA it is
  ``torch.get_rng_state()`` and ``torch.cuda.get_rng_state()``, both CPU tensors
  (torch/utils/checkpoint.py ``get_device_states``; torch/cuda/random.py: "Return the random number
  generator state of the specified GPU as a ByteTensor", made by ``default_generator.get_state()`` on
  the host): nothing on the device, so the simulation counts them for CPU targets only.

Not modelled: an allocation served from a cached block larger than it, which the allocator does not
split (large blocks are split only when more than 1 MiB would remain, ``should_split``), counts the
whole block; how often that happens depends on the allocator's history.
"""
from __future__ import annotations

import os
import re
from typing import Any

import torch

from .registry import RuleContext, nbytes, rule, scratch_rule

aten = torch.ops.aten

# c10/cuda/CUDACachingAllocator.cpp: ``constexpr size_t kMinBlockSize = 512; // all sizes are rounded
# to at least 512 bytes`` and ``round_size``: ``kMinBlockSize * ((size + kMinBlockSize - 1) /
# kMinBlockSize)`` (sizes under 512 become 512), unless PYTORCH_CUDA_ALLOC_CONF sets
# ``roundup_power2_divisions`` (off by default). ``allocated_bytes``, which max_memory_allocated
# reports, grows by the block's size.
MIN_BLOCK = 512

rule(None, "cuda", "every allocation is rounded up to a multiple of 512 bytes (at least 512)",
     "c10/cuda/CUDACachingAllocator.cpp: kMinBlockSize = 512 and round_size(); allocated_bytes counts block sizes",
     granularity=MIN_BLOCK, applies=lambda op: False)


# --- cuBLAS workspace -----------------------------------------------------------------------------
# aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize(): ":4096:2:16:8 default, 32MiB for
# Hopper" -- 4096 * 8 * 1024 bytes on sm90, else 4096 * 1024 * 2 + 16 * 1024 * 8; CUBLAS_WORKSPACE_CONFIG
# (":SIZE_KIB:COUNT" pairs) overrides it.  parseCUDABlasLtWorkspaceSize(): 1024 KiB for cuBLASLt
# (CUBLASLT_WORKSPACE_SIZE in KiB overrides it, capped at the cuBLAS size), a separate allocation
# unless TORCH_CUBLASLT_UNIFIED_WORKSPACE=1.
_HOPPER = 4096 * 8 * 1024
_OTHER = 4096 * 1024 * 2 + 16 * 1024 * 8
_LT = 1024 * 1024


def cublas_workspace_bytes(env: dict[str, str] | None = None) -> int:
    """The cuBLAS and cuBLASLt workspaces of one (handle, stream), as torch sizes them: the larger
    default (Hopper's) when the GPU is not known, the environment's sizes when it sets them."""
    env = os.environ if env is None else env
    config = env.get("CUBLAS_WORKSPACE_CONFIG")
    pairs = re.findall(r":([0-9]+):([0-9]+)", config or "")
    blas = sum(int(size) * 1024 * int(count) for size, count in pairs) if pairs else max(_HOPPER, _OTHER)
    try:
        lt = int(env["CUBLASLT_WORKSPACE_SIZE"]) * 1024
    except (KeyError, ValueError):
        lt = _LT
    if env.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE") in ("1", "true", "True", "ON", "on"):
        return blas
    return blas + min(lt, blas)


rule(None, "cuda",
     "the cuBLAS (32 MiB on Hopper) and cuBLASLt (1 MiB) workspaces: allocated by the process's first matmul and "
     "cached per handle and stream for its life, so every step after the first starts with them: counted as "
     "resident bytes of the step (held once, not per op)",
     "aten/src/ATen/cuda/CublasHandlePool.cpp: parseChosenWorkspaceSize, parseCUDABlasLtWorkspaceSize, "
     "setWorkspaceForHandle (allocated through the caching allocator, kept in a per (handle, stream) map); "
     "CUBLAS_WORKSPACE_CONFIG / CUBLASLT_WORKSPACE_SIZE are read",
     workspace=lambda ctx: cublas_workspace_bytes(), applies=lambda op: False)


# --- cuDNN convolution ----------------------------------------------------------------------------
@scratch_rule([aten.convolution.default, aten.convolution_backward.default], "cuda",
              "cuDNN workspace of the chosen algorithm: bounded by one buffer the size of the op's largest operand "
              "(input, output or weight)",
              "bound, not measured: aten/src/ATen/native/cudnn/Conv_v8.cpp allocates the plan's workspace through "
              "the caching allocator per call and frees it after; heuristics-mode plans (cudnn.benchmark=False) are "
              "implicit-GEMM kernels whose workspace stays below an operand (a layout transform at most); "
              "benchmark mode may pick FFT plans with more")
def _cudnn_conv(args: tuple, kwargs: dict, out: Any, ctx: RuleContext) -> int:
    outputs = out if isinstance(out, (tuple, list)) else (out,)
    return max((nbytes(t) for t in (*args[:3], *outputs) if isinstance(t, torch.Tensor)), default=0)


# --- fused attention backward ---------------------------------------------------------------------
def _round(n: int, m: int) -> int:
    return -(-n // m) * m


@scratch_rule(aten._scaled_dot_product_flash_attention_backward.default, "cuda",
              "float accumulators of the flash backward: dq_accum [B, round128(Lq), H, round32(D)] and "
              "softmax_d [B, H, round128(Lq)]",
              "derived: mha_bwd in aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp (seqlen_q_rounded "
              "= round_multiple(seqlen_q, 128), head_size_rounded = round_multiple(head_size, 32), 256 above 192)")
def _flash_backward(args: tuple, kwargs: dict, out: Any, ctx: RuleContext) -> int:
    q = args[1]  # (grad_out, query, key, value, out, logsumexp, ...), query [B, H, Lq, D]
    b, h, lq, d = q.shape
    d_rounded = _round(d, 32) if d <= 192 else 256
    return 4 * b * _round(lq, 128) * h * d_rounded + 4 * b * h * _round(lq, 128)


@scratch_rule(aten._scaled_dot_product_efficient_attention_backward.default, "cuda",
              "float accumulators of the memory-efficient backward: at most a float copy of query, key and value "
              "plus delta [B, H, Lq]",
              "bound: AttentionBackwardKernel::Params::workspace_size in aten/src/ATen/native/transformers/cuda/"
              "mem_eff_attention/kernel_backward.h (float accumulators for gQ, gK, gV when the kernel needs them) "
              "and the delta buffer of _efficient_attention_backward")
def _efficient_backward(args: tuple, kwargs: dict, out: Any, ctx: RuleContext) -> int:
    q, k, v = args[1], args[2], args[3]
    b, h, lq, _ = q.shape
    return 4 * (q.numel() + k.numel() + v.numel()) + 4 * b * h * lq

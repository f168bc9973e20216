"""CPU rules besides convolution: BLAS operand copies, normalization and softmax scratch, output
layouts of the CPU kernels, wrapped and saved Python numbers.

Each number was measured against the CPU allocator's own events (``measure_peak``), op by op, on
x86-64 with torch 2.14.1; ``source`` says which scan.  They are the fallback when scratch cannot be
measured on the planning machine (``profiler/calibrate.py``), so each takes the largest case seen.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch._prims_common import suggest_memory_format

from .registry import RuleContext, nbytes, rule, scratch_rule

aten = torch.ops.aten


def channels_last(t: torch.Tensor) -> bool:
    """A 4-D tensor laid out channels-last (and not also contiguous)."""
    return t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)


def copy_if_strided(t: torch.Tensor) -> int:
    """Kernels that need a dense operand copy a non-contiguous one first."""
    return 0 if t.is_contiguous() else nbytes(t)


def to_channels_last(t: torch.Tensor) -> int:
    """Kernels that work channels-last convert an operand in another layout first."""
    return 0 if t.dim() != 4 or t.is_contiguous(memory_format=torch.channels_last) else nbytes(t)


# --- matrix products ------------------------------------------------------------------------------
def _blas_ok(t: torch.Tensor) -> bool:
    """Can BLAS read this matrix (or batch of matrices) through its strides, as is or transposed?"""
    if t.dim() < 2:
        return True
    rows, cols = t.shape[-2], t.shape[-1]
    s_rows, s_cols = t.stride()[-2], t.stride()[-1]
    if t.dim() == 3 and t.shape[0] > 1 and t.stride()[0] == 0:
        return False
    return (s_cols == 1 and s_rows >= max(1, cols)) or (s_rows == 1 and s_cols >= max(1, rows))


def _matmul_copies(*operands: Any) -> int:
    return sum(nbytes(t) for t in operands if isinstance(t, torch.Tensor) and not _blas_ok(t))


_BLAS = "measured: mm/bmm with expanded (zero-stride) and permuted operands, 64-1024 rows"


@scratch_rule([aten.mm.default, aten.bmm.default], "cpu", "an operand BLAS cannot stride through is copied dense", _BLAS)
def _mm(args: tuple, kwargs: dict, out: Any, ctx: RuleContext) -> int:
    return _matmul_copies(args[0], args[1])


@scratch_rule([aten.addmm.default, aten.baddbmm.default], "cpu",
              "an operand BLAS cannot stride through is copied dense", _BLAS)
def _addmm(args: tuple, kwargs: dict, out: Any, ctx: RuleContext) -> int:
    return _matmul_copies(args[1], args[2])


# --- normalization --------------------------------------------------------------------------------
@scratch_rule(aten.native_batch_norm.default, "cpu", "training: per-channel float sums (channels-last: 4 of them, "
              "bf16/fp16: 6); bf16/fp16: a strided or channels-last input copied dense (bounded in fp32)",
              "measured: BatchNorm2d forward, channels 3-512, contiguous and channels-last (fp32); derived for bf16: "
              "aten/src/ATen/native/Normalization.cpp takes the contiguous path for reduced types")
def _batch_norm(args: tuple, kwargs: dict, out: Any, ctx: RuleContext) -> int:
    x, train = args[0], args[5] if len(args) > 5 else False
    if x.dim() < 2:
        return 0
    sums = (6 if x.dtype in _REDUCED else 4 if channels_last(x) else 2) * x.shape[1] * 4 if train else 0
    return sums + _reduced_strided(x)


_REDUCED = (torch.bfloat16, torch.float16)


def _reduced_strided(*ts: torch.Tensor) -> int:
    """bf16/fp16 batch norm has no strided or channels-last path: such an operand is copied dense, at
    most in fp32 (numel x 4 B bounds a copy in either precision)."""
    return sum(t.numel() * 4 for t in ts if isinstance(t, torch.Tensor) and t.dtype in _REDUCED and not t.is_contiguous())


@scratch_rule(aten.native_batch_norm_backward.default, "cpu",
              "training, grad_output laid out like the input: an input-sized buffer for the normalized input; "
              "bf16/fp16: strided operands copied dense (bounded in fp32) and per-channel float sums",
              "measured: BatchNorm2d backward with input/weight gradients masked on and off, both layouts (fp32); "
              "bf16 as the forward")
def _batch_norm_backward(args: tuple, kwargs: dict, out: Any, ctx: RuleContext) -> int:
    grad_out, x = args[0], args[1]
    return _batch_norm_backward_fp32(args) + _reduced_strided(grad_out, x) + (
        6 * x.shape[1] * 4 if x.dtype in _REDUCED and x.dim() > 1 else 0)


def _batch_norm_backward_fp32(args: tuple) -> int:
    grad_out, x = args[0], args[1]
    train = args[7] if len(args) > 7 else True
    mask = args[9] if len(args) > 9 else (True, True, True)
    channels = x.shape[1] if x.dim() > 1 else 1
    if grad_out.stride() != x.stride():
        return channels * 4
    if train and mask[0]:
        return nbytes(x)
    return 4 * channels * 4 if channels_last(x) else 0


@scratch_rule(aten.native_layer_norm.default, "cpu", "a non-contiguous input is copied first",
              "measured: LayerNorm on permuted inputs")
def _layer_norm(args: tuple, kwargs: dict, out: Any, ctx: RuleContext) -> int:
    return copy_if_strided(args[0])


@scratch_rule(aten.native_layer_norm_backward.default, "cpu",
              "strided operands copied; each thread accumulates weight and bias gradients in float",
              "measured: LayerNorm backward, widths 8-4096, 1-4 threads, permuted inputs")
def _layer_norm_backward(args: tuple, kwargs: dict, out: Any, ctx: RuleContext) -> int:
    partials = ctx.threads * 2 * math.prod(args[2]) * 4
    return copy_if_strided(args[0]) + copy_if_strided(args[1]) + partials


# Per-thread bookkeeping of the channels-last group norm kernel: measured under 1 KiB per thread.
_GROUP_NORM_PER_THREAD = 1024


@scratch_rule(aten.native_group_norm.default, "cpu",
              "channels-last: per (sample, channel) float sums and a little per thread; "
              "any other strided input is copied contiguous first",
              "measured: GroupNorm(2-32 groups) channels-last, 1-4 threads; permuted inputs (opfuzz seed 865)")
def _group_norm(args: tuple, kwargs: dict, out: Any, ctx: RuleContext) -> int:
    x, n, c = args[0], args[3], args[4]
    return 2 * n * c * 4 + ctx.threads * _GROUP_NORM_PER_THREAD if channels_last(x) else copy_if_strided(x)


@scratch_rule(aten.native_group_norm_backward.default, "cpu",
              "per (sample, channel) float sums after making operands contiguous (or grad channels-last)",
              "measured: GroupNorm backward on contiguous, permuted and channels-last inputs")
def _group_norm_backward(args: tuple, kwargs: dict, out: Any, ctx: RuleContext) -> int:
    grad_out, x, n, c = args[0], args[1], args[5], args[6]
    if channels_last(x):
        return to_channels_last(grad_out) + 2 * n * c * 4
    return copy_if_strided(grad_out) + copy_if_strided(x) + 2 * n * c * 4


def _layer_norm_backward_layout(args: tuple, out: Any) -> Any:
    first = out[0]
    if first is None or first.is_contiguous():
        return out
    return (torch.empty_like(first, memory_format=torch.contiguous_format), *out[1:])


def _group_norm_layout(x: torch.Tensor, out: Any) -> Any:
    if not channels_last(x) or out[0] is None or channels_last(out[0]):
        return out
    return (torch.empty_like(out[0], memory_format=torch.channels_last), *out[1:])


def _batch_norm_layout(x: torch.Tensor, out: Any) -> Any:
    """The CPU batch-norm kernels write their output (forward) and input gradient (backward) in the
    input's suggested memory format: channels-last when it is strided so, else contiguous."""
    first = out[0]
    if first is None:
        return out
    fmt = suggest_memory_format(x)
    if first.is_contiguous(memory_format=fmt):
        return out
    return (torch.empty_like(first, memory_format=fmt), *out[1:])


rule([aten.native_batch_norm.default, aten._native_batch_norm_legit.default], "cpu",
     "the output is laid out in the input's suggested memory format (the fake kernel keeps a permuted input's "
     "strides)", "measured: strides of the CPU kernel's output vs the fake kernel's, 2-D to 5-D inputs in every "
     "layout (tests/test_rules_bounds.py)", layout=lambda args, out: _batch_norm_layout(args[0], out))
rule(aten.native_batch_norm_backward.default, "cpu",
     "the input gradient is laid out in the input's suggested memory format (the fake kernel follows the "
     "gradient's); autograd then copies it to a permuted input's strides (opfuzz seed 6000000485: -33 %)",
     "measured: strides of the CPU kernel's output vs the fake kernel's, 2-D to 5-D inputs in every layout "
     "(tests/test_rules_bounds.py)", layout=lambda args, out: _batch_norm_layout(args[1], out))


rule(aten.native_layer_norm_backward.default, "cpu", "the input gradient comes out contiguous for a strided input",
     "measured: strides of the CPU kernel's output vs the fake kernel's", layout=_layer_norm_backward_layout)
rule(aten.native_group_norm.default, "cpu", "keeps a channels-last input's layout",
     "measured: strides of the CPU kernel's output vs the fake kernel's",
     layout=lambda args, out: _group_norm_layout(args[0], out))
rule(aten.native_group_norm_backward.default, "cpu", "keeps a channels-last input's layout",
     "measured: strides of the CPU kernel's output vs the fake kernel's",
     layout=lambda args, out: _group_norm_layout(args[1], out))


# --- activations, softmax, reductions -------------------------------------------------------------
@scratch_rule(aten.gelu_backward.default, "cpu",
              "exact gelu wants grad in the input's layout: an expanded grad is copied once, another layout twice",
              "measured: gelu_backward with expanded, transposed and matching grads, both approximations")
def _gelu_backward(args: tuple, kwargs: dict, out: Any, ctx: RuleContext) -> int:
    grad, x = args[0], args[1]
    if kwargs.get("approximate", args[2] if len(args) > 2 else "none") != "none" or grad.stride() == x.stride():
        return 0
    return nbytes(x) * (1 if 0 in grad.stride() else 2)


@scratch_rule([aten._softmax.default, aten._log_softmax.default, aten._softmax_backward_data.default,
               aten._log_softmax_backward_data.default], "cpu", "non-contiguous operands are copied first",
              "measured: softmax/log_softmax forward and backward over permuted inputs")
def _softmax(args: tuple, kwargs: dict, out: Any, ctx: RuleContext) -> int:
    return copy_if_strided(args[0])


# A reduction to one value splits over threads above this many elements (ATen's internal grain size).
_REDUCE_GRAIN = 32768


@scratch_rule([aten.sum.default, aten.sum.dim_IntList], "cpu", "a reduction to one value keeps a partial per thread",
              "measured: sum of 1e3-1e7 elements, 1-4 threads")
def _full_reduction(args: tuple, kwargs: dict, out: Any, ctx: RuleContext) -> int:
    x = args[0]
    if not isinstance(out, torch.Tensor) or out.dim() != 0:
        return 0
    return ctx.threads * out.element_size() if x.numel() > _REDUCE_GRAIN else 0


@scratch_rule([aten.mean.default, aten.mean.dim], "cpu", "as sum, and the count it divides by is wrapped (12 B, counted 16)",
              "measured: mean of 1e3-1e7 elements")
def _mean(args: tuple, kwargs: dict, out: Any, ctx: RuleContext) -> int:
    return 16 + _full_reduction(args, kwargs, out, ctx) if isinstance(out, torch.Tensor) else 0


# --- Python numbers -------------------------------------------------------------------------------
@scratch_rule(None, "cpu", "a Python number as the second operand of a Tensor/Scalar overload is wrapped into a "
              "0-dim tensor while the op runs (12 B, counted 16)", "measured: x * 1.0, x > 0, x + 1 on float and bf16",
              applies=lambda op: op._overloadname in ("Tensor", "Scalar"))
def _scalar_operand(args: tuple, kwargs: dict, out: Any, ctx: RuleContext) -> int:
    return 16 if len(args) > 1 and isinstance(args[1], (int, float)) else 0


_SCALAR_SAVING = [aten.mul.Tensor, aten.div.Tensor, aten.mul_.Tensor, aten.div_.Tensor]


def _saved_scalar(args: tuple, ctx: RuleContext) -> int:
    if len(args) < 2 or isinstance(args[1], bool) or not isinstance(args[1], (int, float)):
        return 0
    return 8 if isinstance(args[0], torch.Tensor) and args[0].requires_grad and torch.is_grad_enabled() else 0


rule(_SCALAR_SAVING, "cpu", "autograd keeps the Python-number operand of x * 2.0 or x / 3 as an 8-byte tensor",
     "measured: a chain of x * 2.0 with and without grad; freed only with the autograd graph", held=_saved_scalar)

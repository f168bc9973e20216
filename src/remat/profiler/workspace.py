"""Memory a real CPU kernel allocates inside one op that no aten output shows.

The simulated allocator sees each op's outputs; the real one also sees the kernel's scratch
buffers, which raise the peak while the op runs.  We model the ones that matter on the CPU,
each measured against the allocator's own events (``benchmarks/memory.py``, the tests, and
per-op scans over channels 3-256, kernels 1/3, strides 1/2, batch and spatial sizes, 1-4 threads):

* convolution (oneDNN): source and weight reorders into blocked layouts (channels padded to 16)
  live while the primitive runs, and each result is produced in a blocked buffer and then copied
  out to a dense tensor.  Inputs with few channels stay plain; a strided 1x1 convolution runs on a
  subsampled copy of the input, one image per thread.
* convolution_backward: the same for the data gradient (grad_output and weight reordered), then
  for the weight gradient (input and grad_output reordered), the input gradient already alive;
  every thread past the first reduces into its own weight-sized partial, and each thread keeps
  some kernel scratch (measured 8-56 KiB; counted as 64 KiB).
* mm/addmm/bmm/baddbmm: an operand BLAS cannot read through strides (e.g. an expanded gradient
  with a zero stride) is first copied to a contiguous buffer.
* native_batch_norm_backward: one input-sized buffer for the normalized input (training, when
  the input gradient is wanted and grad_output is laid out like the input).
* native_layer_norm / native_group_norm (backward): non-contiguous operands are copied first;
  layer norm keeps per-thread weight/bias partials, group norm per-(sample, channel) sums.
* the weight gradient of a patchify convolution (kernel == stride, under 8 input channels, as in
  ViTs) keeps, per thread, four weight-sized partials and one image of patches;
* channels-last convolutions run without reorders (an operand in the other layout is converted); the depthwise weight gradient with a kernel of
  5 or more uses a C·kh·kw·256-element reduction scratch.
* gelu_backward (exact) on a grad laid out unlike its input, softmax/log_softmax (forward and
  backward) on a non-contiguous operand: copied first.
* a reduction to one value keeps a partial per thread.
* a Python number as an operand (``x * 1.0``) is wrapped into a small tensor while the op runs.

Where a kernel's choice depends on sizes we do not model, the rule takes the larger of the
measured cases: a prediction may be a little high, never low.  The function returns the extra
bytes above the op's outputs at the op's internal peak.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["workspace_bytes"]

aten = torch.ops.aten


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _blocked(t: torch.Tensor) -> int:
    """Bytes of ``t`` in oneDNN's blocked layout: channels (dim 1) padded to a multiple of 16."""
    if t.dim() < 3:
        return _nbytes(t)
    channels = t.shape[1]
    return _nbytes(t) // max(channels, 1) * (-(-channels // 16) * 16)


def _pad16(n: int) -> int:
    return -(-n // 16) * 16


def _src_reorder(x: torch.Tensor, w: torch.Tensor, min_channels: int = 16) -> int:
    """oneDNN reorders the input into its blocked layout for a 1x1 kernel, and for larger kernels
    from ``min_channels`` input channels on (the forward keeps 8-15 plain, the weight gradient 8)."""
    pointwise = all(k == 1 for k in w.shape[2:])
    return _blocked(x) if pointwise or x.shape[1] >= min_channels else 0


def _blocked_weight(w: torch.Tensor) -> int:
    """A weight reordered for oneDNN: output and input channels padded to multiples of 16."""
    if w.dim() < 3:
        return _nbytes(w)
    return _pad16(w.shape[0]) * _pad16(w.shape[1]) * w[0, 0].numel() * w.element_size()


def _copy_if_strided(t: torch.Tensor) -> int:
    """Non-contiguous operands are made contiguous before the primitive runs."""
    return 0 if t.is_contiguous() else _nbytes(t)


def _strided(stride: Any) -> bool:
    return any(s > 1 for s in stride) if isinstance(stride, (list, tuple)) else stride > 1


def _stride_area(stride: Any) -> int:
    if isinstance(stride, (list, tuple)):
        return max(1, math.prod(stride))
    return max(1, stride)


def _channels_last(t: torch.Tensor) -> bool:
    """A channels-last input: oneDNN computes in that layout directly, with no reorders."""
    return t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)


def _unit_stride_copy(x: torch.Tensor, w: torch.Tensor, stride: Any) -> int:
    """A strided 1x1 convolution runs as a unit-stride one on a subsampled copy of the blocked
    input, one image per thread at a time."""
    if not (_strided(stride) and all(k == 1 for k in w.shape[2:])) or x.dim() < 3:
        return 0
    return _blocked(x) // max(1, x.shape[0]) * max(1, torch.get_num_threads()) // _stride_area(stride)


def _to_channels_last(t: torch.Tensor) -> int:
    """A channels-last convolution converts an operand in another layout first."""
    return 0 if t.dim() != 4 or t.is_contiguous(memory_format=torch.channels_last) else _nbytes(t)


def _conv_forward(args: tuple, kwargs: dict, out: Any) -> int:
    x, w, stride = args[0], args[1], args[3]
    transposed, groups = args[6], args[8]
    if transposed:
        return 0
    if _channels_last(x):
        # only the weight is reordered (dense: twice), plus the per-thread scratch
        return (1 if groups > 1 else 2) * _nbytes(w) + _thread_scratch()
    y = _nbytes(out)
    # (src reorder, weight reorder, blocked output) while the primitive runs, then blocked + dense;
    # a strided 1x1 convolution first subsamples the blocked input, an image per thread
    scratch = _unit_stride_copy(x, w, stride) if groups == 1 else 0
    blocked_y = _blocked(out)
    weight = _blocked_weight(w) if groups == 1 else _nbytes(w)
    peak = _copy_if_strided(x) + max(scratch + _src_reorder(x, w) + weight + blocked_y, blocked_y + y)
    return peak - y + 512  # primitive scratch: up to a few hundred bytes


def _thread_scratch() -> int:
    """oneDNN kernels keep per-thread scratch next to their buffers (measured 8-56 KiB each)."""
    return max(1, torch.get_num_threads()) * 65536


def _weight_grad_scratch(w: torch.Tensor) -> int:
    """Reduction buffers of oneDNN's weight gradient: every thread past the first keeps a
    weight-sized partial, besides its kernel scratch."""
    return (max(1, torch.get_num_threads()) - 1) * _nbytes(w) + _thread_scratch()


def _conv_backward(args: tuple, kwargs: dict, out: Any) -> int:
    grad_out, x, w, stride = args[0], args[1], args[2], args[4]
    transposed, groups, mask = args[7], args[9], args[10]
    if transposed:
        return 0
    xi, wb = _nbytes(x), _nbytes(w)
    gi = xi if mask[0] else 0
    gw = wb if mask[1] else 0
    new = sum(_nbytes(o) for o in out if isinstance(o, torch.Tensor))
    if _channels_last(x):
        # no reorders; a depthwise weight gradient with a kernel of 5 or more reduces through a
        # scratch of C*kh*kw*256 elements (measured with oneDNN on x86, independent of batch and threads)
        depthwise = groups > 1 and groups == x.shape[1] and w.shape[1] == 1
        big = all(k >= 5 for k in w.shape[2:])
        scratch = x.shape[1] * w[0].numel() * 256 * w.element_size() if mask[1] and depthwise and big else 0
        # a grad_output in the other layout is converted first; a strided dense convolution
        # scatters the input gradient through one more buffer and subsamples for a 1x1 kernel
        strided = _strided(stride) and groups == 1
        extra = (gi if strided else 0) + (_unit_stride_copy(x, w, stride) if groups == 1 else 0)
        base = _to_channels_last(grad_out) + _thread_scratch() + extra
        return base + max((1 if groups > 1 else 3) * _nbytes(w), scratch)
    base = _copy_if_strided(grad_out) + _copy_if_strided(x)
    peak = 0
    if mask[0]:
        # grad_output and weight reordered, blocked grad_input, then copied out (a strided
        # dense convolution scatters through one more input-sized buffer)
        blocked_gi = _blocked(x)
        extra = 0
        if _strided(stride) and groups == 1:
            # (few channels: in the blocked layout; and at least one blocked image per thread)
            per_thread = max(1, torch.get_num_threads()) * blocked_gi // max(1, x.shape[0])
            extra = max(gi if x.shape[1] % 16 == 0 else blocked_gi, per_thread)
        peak = max(_blocked(grad_out) + wb + blocked_gi + _thread_scratch(),
                   blocked_gi + gi + extra + 2 * _thread_scratch())
    if mask[1]:
        scratch = _weight_grad_scratch(w) + _unit_stride_copy(x, w, stride) if groups == 1 else 0
        if groups == 1 and x.shape[1] < 16 and not all(k == 1 for k in w.shape[2:]):
            scratch += xi  # under 16 channels, some spatial sizes take a path with a dense input copy
        peak = max(peak, gi + max(_src_reorder(x, w, min_channels=9) + _blocked(grad_out) + gw + scratch, 2 * gw))
        if x.shape[1] < 8 and list(w.shape[2:]) == list(stride):
            # a patchify convolution (kernel == stride) on a few-channel image: each thread keeps
            # four weight-gradient partials and one image's worth of patches
            per_thread = 4 * wb + x[0].numel() * x.element_size()
            peak = max(peak, gi + gw + torch.get_num_threads() * per_thread)
    return max(0, base + peak - new)


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
    return sum(_nbytes(t) for t in operands if isinstance(t, torch.Tensor) and not _blas_ok(t))


def _mm(args: tuple, kwargs: dict, out: Any) -> int:
    return _matmul_copies(args[0], args[1])


def _addmm(args: tuple, kwargs: dict, out: Any) -> int:
    return _matmul_copies(args[1], args[2])


def _layer_norm(args: tuple, kwargs: dict, out: Any) -> int:
    return _copy_if_strided(args[0])


def _layer_norm_backward(args: tuple, kwargs: dict, out: Any) -> int:
    # each thread accumulates its rows' weight and bias gradients in float
    partials = torch.get_num_threads() * 2 * math.prod(args[2]) * 4
    return _copy_if_strided(args[0]) + _copy_if_strided(args[1]) + partials


def _group_norm(args: tuple, kwargs: dict, out: Any) -> int:
    # channels-last: per (sample, channel) partial sums in float, and a little per thread
    x, n, c = args[0], args[3], args[4]
    return 2 * n * c * 4 + torch.get_num_threads() * 1024 if _channels_last(x) else 0


def _group_norm_backward(args: tuple, kwargs: dict, out: Any) -> int:
    # per (sample, channel) sums ds and db in float, after making the operands contiguous (or,
    # for a channels-last input, grad_output channels-last)
    grad_out, x, n, c = args[0], args[1], args[5], args[6]
    if _channels_last(x):
        return _to_channels_last(grad_out) + 2 * n * c * 4
    return _copy_if_strided(grad_out) + _copy_if_strided(x) + 2 * n * c * 4


def _batch_norm(args: tuple, kwargs: dict, out: Any) -> int:
    # training: per-channel sums in float while the statistics are computed (channels-last: 4)
    x, train = args[0], args[5] if len(args) > 5 else False
    if not train or x.dim() < 2:
        return 0
    return (4 if _channels_last(x) else 2) * x.shape[1] * 4


def _batch_norm_backward(args: tuple, kwargs: dict, out: Any) -> int:
    # training, grad_output laid out like the input (the fast path): one input-sized buffer for
    # the normalized input when the input gradient is wanted; otherwise per-channel sums only
    grad_out, x = args[0], args[1]
    train = args[7] if len(args) > 7 else True
    mask = args[9] if len(args) > 9 else (True, True, True)
    channels = x.shape[1] if x.dim() > 1 else 1
    if grad_out.stride() != x.stride():
        return channels * 4
    if train and mask[0]:
        return _nbytes(x)
    return 4 * channels * 4 if _channels_last(x) else 0


def _gelu_backward(args: tuple, kwargs: dict, out: Any) -> int:
    # the exact (erf) kernel wants grad in self's layout: an expanded grad is copied once,
    # a differently strided one twice; the tanh approximation reads any layout
    grad, x = args[0], args[1]
    if kwargs.get("approximate", args[2] if len(args) > 2 else "none") != "none" or grad.stride() == x.stride():
        return 0
    return _nbytes(x) * (1 if 0 in grad.stride() else 2)


def _softmax(args: tuple, kwargs: dict, out: Any) -> int:
    return _copy_if_strided(args[0])  # forward and backward run on contiguous operands


def _full_reduction(args: tuple, kwargs: dict, out: Any) -> int:
    # a reduction to one value splits over threads (above 32768 elements), one partial each
    x = args[0]
    if not isinstance(out, torch.Tensor) or out.dim() != 0:
        return 0
    return torch.get_num_threads() * out.element_size() if x.numel() > 32768 else 0


def _mean(args: tuple, kwargs: dict, out: Any) -> int:
    # and mean divides by a wrapped count (12 bytes measured)
    return 16 + _full_reduction(args, kwargs, out) if isinstance(out, torch.Tensor) else 0


_RULES: dict[Any, Callable[[tuple, dict, Any], int]] = {
    aten.convolution.default: _conv_forward,
    aten.convolution_backward.default: _conv_backward,
    aten.mm.default: _mm,
    aten.bmm.default: _mm,
    aten.addmm.default: _addmm,
    aten.baddbmm.default: _addmm,
    aten.native_batch_norm.default: _batch_norm,
    aten.sum.default: _full_reduction,
    aten.sum.dim_IntList: _full_reduction,
    aten.mean.default: _mean,
    aten.mean.dim: _mean,
    aten.native_batch_norm_backward.default: _batch_norm_backward,
    aten.native_layer_norm.default: _layer_norm,
    aten.native_layer_norm_backward.default: _layer_norm_backward,
    aten.native_group_norm.default: _group_norm,
    aten.native_group_norm_backward.default: _group_norm_backward,
    aten.gelu_backward.default: _gelu_backward,
    aten._softmax.default: _softmax,
    aten._log_softmax.default: _softmax,
    aten._softmax_backward_data.default: _softmax,
    aten._log_softmax_backward_data.default: _softmax,
}


def _scalar_operand(func: Any, args: tuple) -> int:
    """A Python number as the second operand (``x * 1.0``, ``x > 0``) is wrapped into a 0-dim
    tensor and cast while the op runs: 12 bytes measured, counted as 16."""
    if getattr(func, "_overloadname", "") in ("Tensor", "Scalar") and len(args) > 1:
        return 16 if isinstance(args[1], (int, float)) else 0
    return 0


def workspace_bytes(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """Hidden scratch bytes of one CPU op (0 for ops and devices we do not model)."""
    first = args[0] if args else None
    if not isinstance(first, torch.Tensor) or first.device.type != "cpu":
        return 0
    rule = _RULES.get(func)
    return _scalar_operand(func, args) + (rule(args, kwargs, out) if rule is not None else 0)

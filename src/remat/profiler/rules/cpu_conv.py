"""CPU convolution scratch (oneDNN): reorders into blocked layouts, blocked results copied out,
per-thread partials of the weight gradient.

Measured against the allocator's events per op with scans over channels 3-256, kernels 1/3,
strides 1/2, batch and spatial sizes and 1-4 threads, on x86-64 with AVX-512 and torch 2.14.1
(session notes of issue 8).  These rules are the fallback when the planning machine cannot run the
op (``profiler/calibrate.py`` measures it otherwise); where a kernel's choice depends on sizes they
do not model they take the larger of the measured cases.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from .registry import RuleContext, nbytes, scratch_rule
from .cpu import channels_last, copy_if_strided, to_channels_last

aten = torch.ops.aten

# oneDNN's fp32 blocked layouts group channels by the SIMD width: 16 with AVX-512 (8 with AVX2, so
# 16 over-counts there, never under).
BLOCK = 16
# Scratch each oneDNN thread keeps next to its buffers: measured 8-56 KiB per thread.
THREAD_SCRATCH = 64 * 1024
# A primitive's own bookkeeping: measured up to a few hundred bytes.
PRIMITIVE_SCRATCH = 512
# Under this many input channels oneDNN keeps the source plain (forward: 8-15 stay plain, the
# weight gradient reorders from 9 on).
PLAIN_BELOW = 16
PLAIN_BELOW_WEIGHT_GRAD = 9
# Patchify convolutions (kernel == stride, as in ViTs) on fewer channels than this take a path
# with per-thread weight partials.
PATCHIFY_CHANNELS = 8
# Depthwise weight gradients with kernels of this size or more reduce through C*kh*kw*256 elements.
DEPTHWISE_BIG_KERNEL = 5
DEPTHWISE_REDUCTION = 256


def _pad(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


def _blocked(t: torch.Tensor) -> int:
    """Bytes of ``t`` in oneDNN's blocked layout: channels (dim 1) padded to a multiple of BLOCK."""
    if t.dim() < 3:
        return nbytes(t)
    channels = t.shape[1]
    return nbytes(t) // max(channels, 1) * _pad(channels)


def _blocked_weight(w: torch.Tensor) -> int:
    """A weight reordered for oneDNN: output and input channels padded to multiples of BLOCK."""
    if w.dim() < 3:
        return nbytes(w)
    return _pad(w.shape[0]) * _pad(w.shape[1]) * w[0, 0].numel() * w.element_size()


def _src_reorder(x: torch.Tensor, w: torch.Tensor, min_channels: int = PLAIN_BELOW) -> int:
    """oneDNN reorders the input into its blocked layout for a 1x1 kernel, and for larger kernels
    from ``min_channels`` input channels on."""
    pointwise = all(k == 1 for k in w.shape[2:])
    return _blocked(x) if pointwise or x.shape[1] >= min_channels else 0


def _strided(stride: Any) -> bool:
    return any(s > 1 for s in stride) if isinstance(stride, (list, tuple)) else stride > 1


def _stride_area(stride: Any) -> int:
    if isinstance(stride, (list, tuple)):
        return max(1, math.prod(stride))
    return max(1, stride)


def _unit_stride_copy(x: torch.Tensor, w: torch.Tensor, stride: Any, threads: int) -> int:
    """A strided 1x1 convolution runs as a unit-stride one on a subsampled copy of the blocked
    input, one image per thread at a time."""
    if not (_strided(stride) and all(k == 1 for k in w.shape[2:])) or x.dim() < 3:
        return 0
    return _blocked(x) // max(1, x.shape[0]) * max(1, threads) // _stride_area(stride)


def _thread_scratch(threads: int) -> int:
    return max(1, threads) * THREAD_SCRATCH


def _fp32(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * 4


# The weight's fp32 copies a convolution's primitives may hold at once: reordered for the forward,
# transposed for the data gradient, the weight gradient in the kernel's layout and its copy back to
# the user's layout (the per-thread partials of the weight gradient are counted apart).
WEIGHT_COPIES = 4


def gemm_bound(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, transposed: bool, groups: int, threads: int,
               stride: Any = 1, padding: Any = 0) -> int:
    """Kernel memory of a convolution oneDNN runs without a direct (blocked-layout JIT) kernel: the
    gemm-based and reference implementations that dilated, grouped, transposed, 3-D and bf16
    convolutions fall back to.  Derived from their structure: each operand (src, dst and their
    gradients) converted to an fp32 dense copy and once more into the layout the kernel wants (two
    copies each; bf16 operands are computed in fp32), the weight in WEIGHT_COPIES roles plus one
    weight-sized fp32 partial of its gradient per thread, and per thread the im2col (col2im) buffer of one image, (src channels /
    groups) x kernel elements x dst positions (counted over the padded source at the stride's step,
    which is never fewer than the output positions), with oneDNN's per-thread scratch
    (oneDNN: cpu/gemm_convolution_utils.cpp in its src folder: im2col per thread; ref/gemm bf16 convolutions
    accumulate in fp32)."""
    src, dst = (y, x) if transposed else (x, y)
    kernel = math.prod(w.shape[2:])
    col = src.shape[1] // max(1, groups) * kernel * _positions(src, dst, transposed, stride, padding) * 4 \
        if dst.dim() > 2 else 0
    t = max(1, threads)
    # a transposed convolution's operands go through the blocked layout, channels padded to BLOCK
    # (ConvTranspose2d 1->1 and 3->6 on 6-7 images: 4.5 and 3.6 MB of scratch, rules_gap/opfuzz
    # seeds 6000000201 and 7314, where fp32 copies of the plain operands bound 0.4 and 3.0 MB)
    copies = (_fp32_blocked(x) + _fp32_blocked(y)) if transposed else (_fp32(x) + _fp32(y))
    return 2 * copies + (t + WEIGHT_COPIES) * _fp32(w) + t * col + _thread_scratch(t)


def _fp32_blocked(t: torch.Tensor) -> int:
    return _blocked(t) // t.element_size() * 4


def _per_dim(v: Any, n: int) -> list[int]:
    return list(v) if isinstance(v, (list, tuple)) else [v] * n


def _positions(src: torch.Tensor, dst: torch.Tensor, transposed: bool, stride: Any, padding: Any) -> int:
    """Output positions, or the padded input's positions at the stride's step where those are more."""
    n = dst.dim() - 2
    out = list(dst.shape[2:])
    if transposed or isinstance(padding, str):
        return math.prod(out)
    strides, pads = _per_dim(stride, n), _per_dim(padding, n)
    return math.prod(max(o, -(-(i + 2 * p) // max(1, s))) for o, i, p, s in zip(out, src.shape[2:], pads, strides))


# Reduced-precision grouped convolutions with a channel multiplier (groups > 1, not one output per
# input channel) take a oneDNN path whose memory the structure above does not bound: measured (an
# independent scan, 80 random convolutions and a sweep of batch, channels, size, kernel, stride and
# multiplier) up to 18.4x the fp32 bytes of input plus output, growing with the groups, and for a
# 3-D kernel with many weights per group 7.4x the fp32 weights.  A measured envelope, not a
# derivation: 20x the fp32 bytes of input, output and weights, once per call.
REDUCED_GROUPED_FP32_MULTIPLE = 20


def _reduced_grouped(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, groups: int) -> int:
    plain_depthwise = w.shape[0] == groups and w.shape[1] == 1
    if x.dtype == torch.float32 or groups == 1 or plain_depthwise:
        return 0
    return REDUCED_GROUPED_FP32_MULTIPLE * (_fp32(x) + _fp32(y) + _fp32(w))


@scratch_rule(aten.convolution.default, "cpu",
              "source and weight reordered to blocked layouts, a blocked result copied out; channels-last: "
              "weight reorders and per-thread scratch; a strided 1x1 kernel subsamples an image per thread",
              "measured: oneDNN forward scans (channels 3-256, kernels 1/3, strides 1/2, 1-4 threads)")
def _conv_forward(args: tuple, kwargs: dict, out: Any, ctx: RuleContext) -> int:
    x, w, stride = args[0], args[1], args[3]
    transposed, groups = args[6], args[8]
    bound = max(gemm_bound(x, w, out, transposed, groups, ctx.threads, stride, args[4]),
                _reduced_grouped(x, w, out, groups)) if _no_direct_kernel(x, w, args[5], transposed, groups) else 0
    return max(bound, _onednn_forward(x, w, stride, groups, out, ctx))


def _no_direct_kernel(x: torch.Tensor, w: torch.Tensor, dilation: Any, transposed: bool, groups: int) -> bool:
    """Cases the oneDNN scans behind the direct-kernel numbers did not cover (fp32, 2-D, dense or
    depthwise, undilated, not transposed): they may take a gemm-based or reference kernel."""
    dilated = any(d > 1 for d in dilation) if isinstance(dilation, (list, tuple)) else dilation > 1
    depthwise = groups == x.shape[1] and w.shape[0] == groups
    # a weight laid out otherwise than the input (a channels-last weight on a contiguous input) is
    # reordered outside the scanned path
    mismatched = w.dim() == 4 and channels_last(w) != channels_last(x)
    return (transposed or dilated or x.dtype != torch.float32 or x.dim() != 4
            or (groups > 1 and not depthwise) or mismatched)


def _onednn_forward(x: torch.Tensor, w: torch.Tensor, stride: Any, groups: int, out: Any, ctx: RuleContext) -> int:
    if channels_last(x):
        # only the weight is reordered (dense: twice), plus the per-thread scratch
        return (1 if groups > 1 else 2) * nbytes(w) + _thread_scratch(ctx.threads)
    y = nbytes(out)
    # (src reorder, weight reorder, blocked output) while the primitive runs, then blocked + dense
    scratch = _unit_stride_copy(x, w, stride, ctx.threads) if groups == 1 else 0
    blocked_y = _blocked(out)
    # grouped and depthwise sources are reordered at any channel count, and their weight with its
    # output channels padded to BLOCK (Conv2d 2->2, groups 2, on 6x2x27x51: 583 KB measured = blocked
    # source + blocked output + a few KB; rules_gap seed 7306)
    weight = _blocked_weight(w) if groups == 1 else _pad(w.shape[0]) * w[0].numel() * w.element_size()
    src = _blocked(x) if groups > 1 else _src_reorder(x, w)
    peak = copy_if_strided(x) + max(scratch + src + weight + blocked_y, blocked_y + y)
    return peak - y + PRIMITIVE_SCRATCH


def _weight_grad_scratch(w: torch.Tensor, threads: int) -> int:
    """Every thread past the first reduces the weight gradient into its own weight-sized partial."""
    return (max(1, threads) - 1) * nbytes(w) + _thread_scratch(threads)


def _conv_backward_channels_last(grad_out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, stride: Any,
                                 groups: int, mask: Any, threads: int) -> int:
    gi = nbytes(x) if mask[0] else 0
    depthwise = groups > 1 and groups == x.shape[1] and w.shape[1] == 1
    big = all(k >= DEPTHWISE_BIG_KERNEL for k in w.shape[2:])
    scratch = x.shape[1] * w[0].numel() * DEPTHWISE_REDUCTION * w.element_size() if mask[1] and depthwise and big else 0
    # a grad_output in the other layout is converted first; a strided dense convolution scatters the
    # input gradient through one more buffer and subsamples for a 1x1 kernel
    strided = _strided(stride) and groups == 1
    extra = (gi if strided else 0) + (_unit_stride_copy(x, w, stride, threads) if groups == 1 else 0)
    base = to_channels_last(grad_out) + _thread_scratch(threads) + extra
    return base + max((1 if groups > 1 else 3) * nbytes(w), scratch)


@scratch_rule(aten.convolution_backward.default, "cpu",
              "data gradient: grad_output and weight reordered, a blocked grad_input copied out; weight "
              "gradient: input and grad_output reordered, a weight-sized partial per extra thread",
              "measured: oneDNN backward scans (channels 3-256, kernels 1/3, strides 1/2, 1-4 threads)")
def _conv_backward(args: tuple, kwargs: dict, out: Any, ctx: RuleContext) -> int:
    grad_out, x, w, stride = args[0], args[1], args[2], args[4]
    transposed, groups, mask = args[7], args[9], args[10]
    # ATen's mkldnn backward computes the bias gradient with the weight gradient's primitive (the
    # weight gradient made and dropped when only the bias wants one: a frozen weight with a bias);
    # rules_gap seeds 7000-7400: 5 of 6 conv backward shortfalls were mask (False, False, True)
    mask = (mask[0], mask[1] or mask[2], mask[2])
    bound = 0
    if _no_direct_kernel(x, w, args[6], transposed, groups):
        # the data gradient and the weight gradient are two primitives, each bounded as a forward
        bound = sum(gemm_bound(x, w, grad_out, transposed, groups, ctx.threads, stride, args[5]) for m in mask[:2] if m)
        bound = max(bound, _reduced_grouped(x, w, grad_out, groups))
    return max(bound, 0 if transposed else _onednn_backward(grad_out, x, w, stride, groups, mask, out, ctx))


def _onednn_backward(grad_out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, stride: Any, groups: int,
                     mask: Any, out: Any, ctx: RuleContext) -> int:
    threads = ctx.threads
    new = sum(nbytes(o) for o in out if isinstance(o, torch.Tensor))
    if channels_last(x):
        return _conv_backward_channels_last(grad_out, x, w, stride, groups, mask, threads)
    xi, wb = nbytes(x), nbytes(w)
    gi = xi if mask[0] else 0
    gw = wb if mask[1] else 0
    base = copy_if_strided(grad_out) + copy_if_strided(x)
    peak = 0
    if mask[0]:
        blocked_gi = _blocked(x)
        extra = 0
        if _strided(stride) and groups == 1:
            # (few channels: in the blocked layout; and at least one blocked image per thread)
            per_thread = max(1, threads) * blocked_gi // max(1, x.shape[0])
            extra = max(gi if x.shape[1] % BLOCK == 0 else blocked_gi, per_thread)
        peak = max(_blocked(grad_out) + wb + blocked_gi + _thread_scratch(threads),
                   blocked_gi + gi + extra + 2 * _thread_scratch(threads))
    if mask[1]:
        # (a grouped weight gradient keeps its per-thread scratch too: Conv2d 2->2, groups 2, measured
        # 4.6 KB above the rest; rules_gap seed 7306)
        scratch = (_weight_grad_scratch(w, threads) + _unit_stride_copy(x, w, stride, threads) if groups == 1
                   else _thread_scratch(threads))
        if groups == 1 and x.shape[1] < PLAIN_BELOW and not all(k == 1 for k in w.shape[2:]):
            scratch += xi  # under 16 channels, some spatial sizes take a path with a dense input copy
        peak = max(peak, gi + max(_src_reorder(x, w, PLAIN_BELOW_WEIGHT_GRAD) + _blocked(grad_out) + gw + scratch,
                                  2 * gw))
        if x.shape[1] < PATCHIFY_CHANNELS and list(w.shape[2:]) == list(stride):
            # each thread keeps four weight-gradient partials and one image's worth of patches
            per_thread = 4 * wb + x[0].numel() * x.element_size()
            peak = max(peak, gi + gw + threads * per_thread)
    return max(0, base + peak - new)

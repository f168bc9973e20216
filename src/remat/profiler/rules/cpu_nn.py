"""CPU bounds for the nn kernels with buffers of their own: oneDNN RNN layers, flash attention,
embedding bags, reduced-precision matrix products.

Where a bound comes from the kernel's source it says which file; where it is a multiple of a
structural size measured on one machine (the RNN workspace, whose layout oneDNN decides), it says so.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from .registry import RuleContext, nbytes, rule, scratch_rule
from .cpu_generic import LOW_PRECISION, dense_nbytes, strided_copies

aten = torch.ops.aten

# --- oneDNN RNN layers ----------------------------------------------------------------------------
# oneDNN's training workspace keeps, for every step, the gates and the layer, iteration and cell
# states (oneDNN: cpu/rnn/rnn_utils.cpp set_workspace_sizes); its scratchpad holds the gates again and
# the weights packed for the gemm.  In units of g = steps x batch x gates*hidden x 4 B (fp32 gates),
# s = (steps + 1) x batch x (input + hidden) x 4 B (states) and W = fp32 weights: measured
# (calibrate.measure_kernel on LSTM layers, seq 4-62, batch 1-8, input 11-214, hidden 11-245, fp32
# and bf16, 2 threads) the forward's extra output reached 4.3g, or 12g where states dominate (small
# hidden), or W where weights do (4 steps); its scratch 2.7g or 110g = 0.9W; the backward's scratch
# 6.6g or 1.4W.  The bounds below sum the terms with those coefficients rounded up, so each regime
# is covered by its own term.
RNN_WORKSPACE = (4, 6, 1)  # (gates, states, weights) multiples of the forward's workspace
RNN_FORWARD_SCRATCH = (3, 0, 2)
RNN_BACKWARD_SCRATCH = (7, 6, 2)
RNN_THREAD_SCRATCH = 64 * 1024


def _rnn_units(args: tuple) -> tuple[int, int, int]:
    x, w_ih, w_hh = args[0], args[1], args[2]
    steps_batch = x.numel() // max(1, x.shape[-1])
    gates = steps_batch * w_ih.shape[0] * 4
    batch = x.shape[1] if x.dim() == 3 else 1
    states = (x.shape[0] + 1) * batch * (x.shape[-1] + w_hh.shape[-1]) * 4 if x.dim() == 3 else steps_batch * 8
    weights = sum(t.numel() * 4 for t in args[1:5] if isinstance(t, torch.Tensor))
    return gates, states, weights


def _rnn_bound(args: tuple, coeffs: tuple[int, int, int]) -> int:
    return sum(c * u for c, u in zip(coeffs, _rnn_units(args)))


if hasattr(aten, "mkldnn_rnn_layer"):
    rule(aten.mkldnn_rnn_layer.default, "cpu",
         "the workspace the backward reads (returned empty by the fake kernel), held with the outputs",
         "measured: LSTM layer scans, terms in gates, states and weights (see cpu_nn.py)",
         extra_out=lambda args, kwargs, out, ctx: _rnn_bound(args, RNN_WORKSPACE))

    @scratch_rule(aten.mkldnn_rnn_layer.default, "cpu", "scratchpad: the gates once more and packed weights",
                  "measured: LSTM layer scans (see cpu_nn.py)")
    def _rnn_forward(args: tuple, kwargs: dict, out: Any, ctx: RuleContext) -> int:
        return _rnn_bound(args, RNN_FORWARD_SCRATCH) + max(1, ctx.threads) * RNN_THREAD_SCRATCH + strided_copies(args, kwargs, out)

if hasattr(aten, "mkldnn_rnn_layer_backward"):
    @scratch_rule(aten.mkldnn_rnn_layer_backward.default, "cpu",
                  "gate gradients per step, diff states, weight-gradient partials and packed weights",
                  "measured: LSTM layer scans (see cpu_nn.py)")
    def _rnn_backward(args: tuple, kwargs: dict, out: Any, ctx: RuleContext) -> int:
        return (_rnn_bound(args, RNN_BACKWARD_SCRATCH) + max(1, ctx.threads) * RNN_THREAD_SCRATCH
                + strided_copies(args, kwargs, out))


# --- flash attention (CPU) ------------------------------------------------------------------------
KV_SPLIT = 512  # FlashAttentionKernel.cpp: kv_split_size


def _q_split(q_len: int) -> int:
    """FlashAttentionKernel.cpp: q_split_size 256 from 768 queries on, 64 from 192, else 32."""
    return 256 if q_len >= 768 else 64 if q_len >= 192 else 32


def _attention_sizes(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int, int]:
    qs, ks = min(_q_split(q.shape[-2]), q.shape[-2]), min(KV_SPLIT, k.shape[-2])
    return qs, ks, q.shape[-1]


@scratch_rule(aten._scaled_dot_product_flash_attention_for_cpu.default, "cpu",
              "per thread: a query block x key block of fp32 scores, row max and sum, an fp32 output block "
              "(and a reduced-precision copy of the scores for bf16); strided q, k, v copied",
              "derived: aten/src/ATen/native/cpu/FlashAttentionKernel.cpp cpu_flash_attention (buf, buf_reduced)")
def _flash_forward(args: tuple, kwargs: dict, out: Any, ctx: RuleContext) -> int:
    q, k, v = args[0], args[1], args[2]
    qs, ks, d = _attention_sizes(q, k)
    per_thread = (qs * ks + 2 * qs + qs * max(d, v.shape[-1])) * 4 + (qs * ks * q.element_size() if q.dtype in LOW_PRECISION else 0)
    return max(1, ctx.threads) * per_thread + strided_copies(args, kwargs, out)


@scratch_rule(aten._scaled_dot_product_flash_attention_for_cpu_backward.default, "cpu",
              "per thread: fp32 scores and their gradient for a query block x key block (bf16: reduced copies and "
              "fp32 accumulators of the q/k/v gradients); strided operands copied",
              "derived: aten/src/ATen/native/cpu/FlashAttentionKernel.cpp cpu_flash_attention_backward")
def _flash_backward(args: tuple, kwargs: dict, out: Any, ctx: RuleContext) -> int:
    q, k = args[1], args[2]
    qs, ks, d = _attention_sizes(q, k)
    qs = max(qs, min(q.shape[-2], 64))  # the backward splits queries in its own blocks
    per_thread = 2 * qs * ks * 4
    accum = 0
    if q.dtype in LOW_PRECISION:
        per_thread += 2 * qs * ks * q.element_size() + qs * d * 4
        accum = sum(t.numel() * 4 for t in args[1:4])  # dq, dk, dv accumulated in fp32
    return max(1, ctx.threads) * per_thread + accum + strided_copies(args, kwargs, out)


# --- embedding bags -------------------------------------------------------------------------------
def _bag_index_buffers(indices: torch.Tensor, weight_rows: int) -> int:
    """int64 copies of the indices (from int32), offset2bag, the sorted indices and their permutation,
    and a count per weight row."""
    return 4 * indices.numel() * 8 + weight_rows * 8


@scratch_rule([aten._embedding_bag.default, aten._embedding_bag_forward_only.default], "cpu",
              "index buffers: int64 indices, offset2bag, bag sizes", "derived: aten/src/ATen/native/EmbeddingBag.cpp "
              "(make_offset2bag, index conversion to int64)")
def _bag_forward(args: tuple, kwargs: dict, out: Any, ctx: RuleContext) -> int:
    return 4 * args[1].numel() * 8 + strided_copies(args, kwargs, out)


def _bag_backward(args: tuple, kwargs: dict, out: Any, ctx: RuleContext) -> int:
    grad, indices = args[0], args[1]
    rows = next((a for a in args[2:] if isinstance(a, int) and not isinstance(a, bool)), 0)
    dim = grad.shape[-1] if grad.dim() else 1
    upcast = rows * dim * 4 if grad.dtype in LOW_PRECISION else 0
    return grad.numel() * grad.element_size() + _bag_index_buffers(indices, rows) + upcast


rule(aten.embedding_dense_backward.default, "cpu",
     "a dense copy of the gradient, sorted indices with their permutation and counts, and for bf16/fp16 an fp32 "
     "weight gradient accumulated and cast", "derived: aten/src/ATen/native/Embedding.cpp embedding_dense_backward_cpu",
     scratch=_bag_backward)

# The ``mode`` argument of each bag backward (its schema position); 2 is max.
_BAG_MODE = {aten._embedding_bag_backward.default: 8, aten._embedding_bag_dense_backward.default: 7}
MODE_MAX = 2


def _max_bag_backward(args: tuple) -> int:
    """Max mode gathers, for every non-empty bag, the int64 index of each column's maximum and that
    gradient row (``index_select`` by ``bag_size.nonzero()``, made twice), then scatters column by
    column; a non-contiguous gradient (``.sum()``'s expanded one) is first made dense.  How many bags
    are empty depends on the offsets' values: the bound takes them all non-empty."""
    grad = args[0]
    bags = grad.shape[0] if grad.dim() else 1
    columns = grad.shape[-1] if grad.dim() > 1 else 1
    dense = dense_nbytes(grad) if not grad.is_contiguous() else 0
    return bags * columns * (8 + grad.element_size()) + 2 * bags * 8 + dense


for _op, _mode in _BAG_MODE.items():
    rule(_op, "cpu",
         "sum/mean: a dense copy of the gradient, sorted indices with their permutation and counts, and for "
         "bf16/fp16 an fp32 weight gradient accumulated and cast; max: the maxima's indices and gradient rows "
         "gathered per non-empty bag instead (index values decide how many: bounded with every bag non-empty)",
         "derived: aten/src/ATen/native/EmbeddingBag.cpp _embedding_bag_dense_backward_cpu(_max); max mode "
         "measured at 10 B (bf16) and 12 B (fp32) per bag and column, +4 B for .sum()'s expanded gradient",
         scratch=lambda args, kwargs, out, ctx, _m=_mode: (_max_bag_backward(args) if args[_m] == MODE_MAX
                                                           else _bag_backward(args, kwargs, out, ctx)),
         value_bound=lambda args, kwargs, _m=_mode: args[_m] == MODE_MAX)


# --- reduced-precision matrix products ------------------------------------------------------------
# oneDNN's per-thread scratch beside its buffers (as for convolutions, cpu_conv.THREAD_SCRATCH).
MATMUL_THREAD_SCRATCH = 64 * 1024


def _low_precision_matmul(a: torch.Tensor, b: torch.Tensor, out: Any, threads: int) -> int:
    """bf16/fp16 products run through oneDNN: operands converted to fp32 (or packed), an fp32
    accumulator of the result, and oneDNN's per-thread scratch."""
    if a.dtype not in LOW_PRECISION:
        return 0
    return (a.numel() + b.numel() + nbytes(out) // max(1, out.element_size())) * 4 + max(1, threads) * MATMUL_THREAD_SCRATCH


@scratch_rule([aten.mm.default, aten.bmm.default], "cpu", "bf16/fp16: fp32 operand copies and accumulator, per-thread "
              "scratch", "derived: aten/src/ATen/native/mkldnn/Matmul.cpp (bf16 gemm through oneDNN accumulates in fp32)")
def _mm_low(args: tuple, kwargs: dict, out: Any, ctx: RuleContext) -> int:
    return _low_precision_matmul(args[0], args[1], out, ctx.threads)


@scratch_rule([aten.addmm.default, aten.baddbmm.default], "cpu", "bf16/fp16: fp32 operand copies and accumulator, "
              "per-thread scratch", "derived: aten/src/ATen/native/mkldnn/Matmul.cpp")
def _addmm_low(args: tuple, kwargs: dict, out: Any, ctx: RuleContext) -> int:
    return _low_precision_matmul(args[1], args[2], out, ctx.threads)


# --- interpolation --------------------------------------------------------------------------------
UPSAMPLE = ["upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "_upsample_nearest_exact1d",
            "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
            "_upsample_bilinear2d_aa", "upsample_bicubic2d", "_upsample_bicubic2d_aa", "upsample_trilinear3d"]


def _upsample_ops(backward: bool) -> list:
    """Every overload of the interpolation kernels (named, not found by dir(): torch.ops.aten lists
    only the ops loaded so far)."""
    ops = []
    for name in UPSAMPLE:
        name += "_backward" if backward else ""
        if hasattr(aten, name):
            packet = getattr(aten, name)
            ops.extend(getattr(packet, o) for o in packet.overloads() if not o.endswith("out"))
    return ops


def _separable(x: torch.Tensor, out_sizes: Any) -> int:
    """An fp32 buffer between the passes of a separable interpolation (batch x channels x, per
    spatial dim, the larger of its input and output size) or dense fp32 copies of input and output
    (reduced types computed in float; nearest kernels restride through a dense copy), whichever is
    more; plus per output position of each dim its source indices and weights (up to 4 taps of
    int64 + float)."""
    if not isinstance(out_sizes, (list, tuple)) or x.dim() < 3:
        return 0
    lead = x.shape[0] * x.shape[1]
    spatial = math.prod(max(i, o) for i, o in zip(x.shape[2:], out_sizes))
    copies = (x.numel() + lead * math.prod(out_sizes)) * 4  # input and output in fp32, dense
    return max(lead * spatial * 4, copies) + sum(out_sizes) * 4 * 12


def _sizes(args: tuple, out: Any) -> list[int] | None:
    return list(out.shape[2:]) if isinstance(out, torch.Tensor) and out.dim() > 2 else None


rule(_upsample_ops(False), "cpu", "operands copied dense, and an fp32 buffer between the separable passes or fp32 "
     "copies of input and output, with per-position indices and weights", "derived: aten/src/ATen/native/cpu/UpSampleKernel.cpp (separable "
     "_upsample_*_generic kernels, reduced types computed in float; index/weight tensors per dim)",
     scratch=lambda args, kwargs, out, ctx: _separable(args[0], _sizes(args, out)) + strided_copies(args, kwargs, out))


def _upsample_backward(args: tuple, kwargs: dict, out: Any, ctx: RuleContext) -> int:
    acc = out.numel() * 4 if isinstance(out, torch.Tensor) and out.dtype in LOW_PRECISION else 0
    return strided_copies(args, kwargs, out) + acc


rule(_upsample_ops(True), "cpu", "the gradient copied dense (an expanded one in full); bf16/fp16: the input "
     "gradient accumulated in fp32 and cast", "derived: aten/src/ATen/native/cpu/UpSampleKernel.cpp "
     "(cpu_upsample_*_backward: grad_output.contiguous(), float accumulation for reduced types)",
     scratch=_upsample_backward)


# --- scatter --------------------------------------------------------------------------------------
@scratch_rule([aten.scatter.src, aten.scatter.value, aten.scatter_add.default, aten.scatter_reduce.two,
               aten.index_put.default, aten.index_add.default, aten.masked_scatter.default], "cpu",
              "out of place: self cloned, and up to two more self-sized buffers while the in-place kernel restrides",
              "derived: the out-of-place ops are self.clone() then the in-place op (aten/src/ATen/native/"
              "TensorAdvancedIndexing.cpp); measured: two self-sized buffers beyond the output for a bf16 "
              "channels-last self (the gradient of torch.max(dim))")
def _scatter(args: tuple, kwargs: dict, out: Any, ctx: RuleContext) -> int:
    return 2 * nbytes(args[0]) + strided_copies(args, kwargs, out)

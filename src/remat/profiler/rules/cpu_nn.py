"""CPU bounds for the nn kernels with buffers of their own: oneDNN RNN layers, flash attention,
embedding bags, reduced-precision matrix products.

Where a bound comes from the kernel's source it says which file; where it is a multiple of a
structural size measured on one machine (the RNN workspace, whose layout oneDNN decides), it says so.
"""
from __future__ import annotations

from typing import Any

import torch

from . import RuleContext, nbytes, rule, scratch_rule
from .cpu_generic import LOW_PRECISION, strided_copies

aten = torch.ops.aten

# --- oneDNN RNN layers ----------------------------------------------------------------------------
# oneDNN's training workspace keeps, for every step, the gates and the layer, iteration and cell
# states (src/cpu/rnn/rnn_utils.cpp set_workspace_sizes); its scratchpad holds the gates again and
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


@scratch_rule([aten._embedding_bag_backward.default, aten._embedding_bag_dense_backward.default,
               aten.embedding_dense_backward.default], "cpu",
              "a dense copy of the gradient, sorted indices with their permutation and counts, and for bf16/fp16 "
              "an fp32 weight gradient accumulated and cast", "derived: aten/src/ATen/native/EmbeddingBag.cpp "
              "_embedding_bag_dense_backward_cpu, aten/src/ATen/native/Embedding.cpp embedding_dense_backward_cpu")
def _bag_backward(args: tuple, kwargs: dict, out: Any, ctx: RuleContext) -> int:
    grad, indices = args[0], args[1]
    rows = next((a for a in args[2:] if isinstance(a, int) and not isinstance(a, bool)), 0)
    dim = grad.shape[-1] if grad.dim() else 1
    upcast = rows * dim * 4 if grad.dtype in LOW_PRECISION else 0
    return grad.numel() * grad.element_size() + _bag_index_buffers(indices, rows) + upcast


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

"""CPU bounds for ops without a rule of their own: derived from how ATen's kernels are written.

Three kinds of kernels, three bounds:

* pointwise (``Tag.pointwise``, TensorIterator): strided operands are read in place, but on CPU an
  operand whose dtype differs from the common dtype is first converted into a temporary
  (``TensorIteratorBase::compute_types``, aten/src/ATen/TensorIterator.cpp: "Promotes inputs by
  creating temporaries of the correct dtype").
* reductions (``Tag.reduction``): the same conversion of the input when it is reduced in another
  dtype (a bool summed into int64; bf16/fp16 ``mean`` sums in fp32, ReduceOps.cpp ``mean_out``),
  plus a partial result per thread (Reduce.h ``parallel_reduce``).
* everything else (pooling, interpolation, embedding, index, scatter, RNN and attention kernels):
  they call ``.contiguous()`` (or ``.contiguous(suggest_memory_format())``) on their operands and
  write a contiguous result that is copied into an output with another layout.  Bound: a dense
  copy of every operand that is not contiguous (an expanded gradient of ``.sum()`` becomes a full
  one), plus, when any operand was copied, one temporary per new output.  A channels-last operand
  counts as non-contiguous: the kernel's suggested format comes from one operand, the others follow.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
from torch._ops import OpOverload

from .registry import RULES, RuleContext, nbytes, scratch_rule

aten = torch.ops.aten

# Ops that copy or concatenate by definition: their output is the copy, strides are handled by
# TensorIterator (or memcpy per slice for cat), so a strided operand costs no extra buffer.
STRIDE_AWARE = frozenset({
    aten.clone.default, aten._to_copy.default, aten.copy_.default, aten.copy.default, aten.cat.default,
    aten.fill_.Scalar,
    aten.fill_.Tensor, aten.zero_.default, aten.zeros_like.default, aten.ones_like.default,
    aten.empty_like.default, aten.full_like.default, aten.expand_copy.default, aten.repeat.default,
    aten.alias_copy.default, aten.lift_fresh_copy.default, aten.new_zeros.default, aten.new_empty.default,
    aten.new_ones.default, aten.new_full.default, aten.scalar_tensor.default,
})

LOW_PRECISION = (torch.bfloat16, torch.float16)


def dense_nbytes(t: torch.Tensor) -> int:
    """Bytes of a contiguous copy of ``t`` (an expanded tensor copies every element it shows)."""
    return t.numel() * t.element_size()


def tensors_in(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in tensors_in(y)]
    return []


def new_outputs(args: tuple, kwargs: dict, out: Any) -> list[torch.Tensor]:
    """Outputs on storages no input has (what the kernel allocates)."""
    inputs = {id(t.untyped_storage()) for t in tensors_in((args, tuple(kwargs.values())))}
    return [t for t in tensors_in(out) if id(t.untyped_storage()) not in inputs]


def strided_copies(args: tuple, kwargs: dict, out: Any) -> int:
    """A dense copy of every non-contiguous operand, and a contiguous temporary for each new output
    when any operand had to be copied (the kernel then writes dense and copies out)."""
    copies = sum(dense_nbytes(t) for t in tensors_in((args, tuple(kwargs.values())))
                 if t.numel() > 1 and not t.is_contiguous())
    if not copies:
        return 0
    return copies + sum(nbytes(t) for t in new_outputs(args, kwargs, out))


def _has_own_rule(op: OpOverload) -> bool:
    return any(r.op is op and r.scratch is not None and r.device in ("cpu", "*") for r in RULES)


def _is_view(op: OpOverload) -> bool:
    returns = [r for r in op._schema.returns if "Tensor" in str(r.type)]
    return not returns or all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


@functools.lru_cache(maxsize=None)
def _generic(op: OpOverload) -> bool:
    return (op.namespace == "aten" and op not in STRIDE_AWARE and not _is_view(op) and not _has_own_rule(op)
            and torch.Tag.pointwise not in op.tags and torch.Tag.reduction not in op.tags)


@functools.lru_cache(maxsize=None)
def _pointwise(op: OpOverload) -> bool:
    return op.namespace == "aten" and torch.Tag.pointwise in op.tags and op not in STRIDE_AWARE and not _has_own_rule(op)


@functools.lru_cache(maxsize=None)
def _reduction(op: OpOverload) -> bool:
    # also where a rule of its own adds per-op partials (sum, mean): the dtype conversion is separate
    return op.namespace == "aten" and torch.Tag.reduction in op.tags


@scratch_rule(None, "cpu", "no rule of its own: a dense copy of each non-contiguous operand, and then a "
              "contiguous temporary per new output", "derived: kernels outside TensorIterator call "
              ".contiguous() on their operands and copy a dense result into a strided output (e.g. "
              "aten/src/ATen/native/DilatedMaxPool2d.cpp, UpSample*.cpp, Embedding.cpp)", applies=_generic)
def _generic_scratch(args: tuple, kwargs: dict, out: Any, ctx: RuleContext) -> int:
    return strided_copies(args, kwargs, out)


def _common_dtype(ts: list[torch.Tensor]) -> torch.dtype | None:
    dims = [t for t in ts if t.dim() > 0] or ts
    if not dims:
        return None
    dtype = dims[0].dtype
    for t in dims[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def promotion_copies(ts: list[torch.Tensor], common: torch.dtype | None) -> int:
    """Temporaries converting each operand (not a 0-dim one: CPU scalars are read as is) to ``common``."""
    if common is None:
        return 0
    size = torch.empty((), dtype=common).element_size()
    return sum(t.numel() * size for t in ts if t.dim() > 0 and t.dtype != common)


@scratch_rule(None, "cpu", "pointwise (TensorIterator): each operand of another dtype than the common one is "
              "converted into a temporary first", "derived: aten/src/ATen/TensorIterator.cpp compute_types "
              "(promote_inputs_to_common_dtype on CPU)", applies=_pointwise)
def _pointwise_scratch(args: tuple, kwargs: dict, out: Any, ctx: RuleContext) -> int:
    inputs = tensors_in((args, tuple(kwargs.values())))
    return promotion_copies(inputs, _common_dtype(inputs))


def reduction_bound(x: torch.Tensor, out: Any, ctx: RuleContext) -> int:
    """A reduction's input converted to the dtype it is reduced in (a bool or int summed into int64,
    a bf16/fp16 input into fp32) with an fp32 result beside it, plus a partial per thread."""
    outs = [t for t in tensors_in(out) if t.is_floating_point() or not t.is_complex()]
    if not outs:
        return 0
    acc = outs[0].dtype
    if acc in LOW_PRECISION or x.dtype in LOW_PRECISION:
        acc = torch.float32
    size = torch.empty((), dtype=acc).element_size()
    cast = x.numel() * size + outs[0].numel() * size if x.dtype != acc else 0
    partials = max(1, ctx.threads) * sum(t.numel() for t in outs) * 8
    return cast + partials


@scratch_rule(None, "cpu", "reduction: the input converted to the dtype it is reduced in (fp32 for bf16/fp16, "
              "int64 for a bool sum) beside an fp32 result, and a partial result per thread",
              "derived: aten/src/ATen/native/ReduceOps.cpp (mean_out casts half types to fp32 and back), "
              "TensorIterator.cpp compute_types, aten/src/ATen/native/cpu/Reduce.h (per-thread accumulators)",
              applies=_reduction)
def _reduction_scratch(args: tuple, kwargs: dict, out: Any, ctx: RuleContext) -> int:
    x = args[0] if args and isinstance(args[0], torch.Tensor) else None
    return reduction_bound(x, out, ctx) if x is not None else 0


@scratch_rule(aten.logsumexp.default, "cpu", "max, then an input-sized exp(x - max) in the result dtype summed",
              "derived: aten/src/ATen/native/ReduceOps.cpp logsumexp_out_impl (self - maxes, exp_, sum_out)")
def _logsumexp(args: tuple, kwargs: dict, out: Any, ctx: RuleContext) -> int:
    x = args[0]
    size = max(4, out.element_size()) if isinstance(out, torch.Tensor) else 4
    return x.numel() * size + 2 * nbytes(out) + reduction_bound(x, out, ctx)


@scratch_rule(aten._safe_softmax.default, "cpu", "softmax, a bool mask of -inf inputs and its row reduction, "
              "then where() writes the output", "derived: aten/src/ATen/native/SoftMax.cpp _safe_softmax")
def _safe_softmax(args: tuple, kwargs: dict, out: Any, ctx: RuleContext) -> int:
    x = args[0]
    return nbytes(out) + x.numel() + x.numel() // max(1, x.shape[args[1]] if x.dim() else 1) + 16 + strided_copies(args, kwargs, out)

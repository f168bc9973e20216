"""Elementwise math and activations: k FLOPs per output element, k = elementary operations.

Convention (docs/design.md): one FLOP per output element per elementary operation; a transcendental
function (exp, log, erf, tanh, sin, ...) counts as one operation.  In-place variants (``relu_``) and
``out=`` overloads share their op's formula.  Ops that only move or create data are listed at the
end as explicit zeros, so the docs say so instead of leaving them silently uncounted.
"""
from __future__ import annotations

from .registry import numel, register, register_zero

_GROUP = "elementwise math and activations"


def _per_output(k: int, names: str, doc: str, group: str = _GROUP) -> None:
    def fn(*args, out_val=None, **kwargs) -> int:
        return k * numel(out_val)

    register(names, f"{k} per output element: {doc}" if doc else f"{k} per output element", group=group)(fn)


def _with_inplace(names: str) -> str:
    return " ".join(f"{n} {n}_" for n in names.split())


# k = 1: one elementary operation per element.
_per_output(1, _with_inplace(
    "add sub rsub mul div neg abs reciprocal sqrt rsqrt exp exp2 expm1 log log2 log10 log1p sin cos tan "
    "asin acos atan atan2 sinh cosh tanh asinh acosh atanh erf erfc erfinv pow float_power maximum minimum fmax fmin "
    "fmod remainder sign sgn floor ceil round trunc frac relu threshold clamp_min clamp_max "
    "eq ne lt le gt ge logical_not logical_and logical_or logical_xor bitwise_not bitwise_and bitwise_or "
    "bitwise_xor bitwise_left_shift bitwise_right_shift isnan isinf isfinite signbit square "
    "xlogy hypot copysign nan_to_num heaviside"
), "one arithmetic, comparison or transcendental op")
_per_output(1, "where masked_fill masked_fill_ bernoulli bernoulli_ uniform_ normal_ exponential_ geometric_ "
               "random_ rand rand_like randn randn_like randint randint_like randperm multinomial",
            "a select, or one random draw")
_per_output(1, "threshold_backward hardshrink softshrink", "compare and select the gradient")
_per_output(2, _with_inplace("addcmul addcdiv clamp hardtanh leaky_relu"),
            "two ops (addcmul/addcdiv: product and add; clamp/hardtanh: min and max; leaky_relu: compare, scale)")
_per_output(2, "hardtanh_backward leaky_relu_backward hardsigmoid_backward", "compare and scale the gradient")
_per_output(3, _with_inplace("lerp softplus relu6 hardsigmoid"),
            "three ops (lerp: a+w·(b−a); softplus: exp, add, log; hardsigmoid: add, clamp)")
_per_output(3, "sigmoid_backward tanh_backward", "g·y·(1−y) or g·(1−y²)")
_per_output(4, _with_inplace("sigmoid log_sigmoid"), "neg, exp, add, reciprocal")
_per_output(4, "softplus_backward log_sigmoid_forward log_sigmoid_backward hardswish_backward",
            "exp/compare, add, divide/scale, multiply")
_per_output(5, _with_inplace("silu hardswish gelu mish elu selu celu"),
            "silu: x·sigmoid(x); hardswish: add, clamp, multiply, divide; gelu (erf form): scale, erf, add, "
            "2 multiplies; mish: exp, add, log, tanh, multiply; elu/selu/celu: compare, exp, sub, 2 multiplies")
_per_output(7, "silu_backward mish_backward elu_backward", "sigmoid (4) and the product rule (3)")
_per_output(8, "gelu_backward", "erf and Gaussian density (exp) of x, and 6 multiply/add")
_per_output(3, "native_dropout", "draw, compare, scale")
_per_output(2, "native_dropout_backward", "mask multiply and scale")
_per_output(7, "upsample_bilinear2d upsample_bicubic2d _upsample_bilinear2d_aa upsample_linear1d upsample_trilinear3d",
            "weighted sum of 4 neighbours (4 multiplies, 3 adds)", group="pooling and resampling")
_per_output(1, "linspace logspace cumsum cumsum_ cumprod cumprod_ logcumsumexp",
            "one op per element", group="reductions")

register_zero(
    "clone copy copy_ _copy_from _copy_from_and_resize _to_copy to cat stack hstack vstack constant_pad_nd "
    "reflection_pad1d reflection_pad2d reflection_pad3d replication_pad1d replication_pad2d replication_pad3d "
    "empty empty_like empty_strided new_empty new_empty_strided zeros zeros_like new_zeros ones ones_like new_ones "
    "full full_like new_full fill fill_ zero_ scalar_tensor arange eye lift_fresh lift_fresh_copy "
    "index index_select gather embedding take slice_backward select_backward as_strided_scatter slice_scatter "
    "select_scatter diagonal_scatter repeat repeat_interleave roll flip tril triu tril_ triu_ im2col "
    "upsample_nearest1d upsample_nearest2d upsample_nearest3d _upsample_nearest_exact2d pixel_shuffle "
    "pixel_unshuffle channel_shuffle native_channel_shuffle _unsafe_view resize_ set_ _reshape_copy "
    "view_copy expand_copy permute_copy t_copy transpose_copy unsqueeze_copy squeeze_copy slice_copy "
    "select_copy split_copy split_with_sizes_copy unbind_copy alias_copy detach_copy as_strided_copy "
    "_local_scalar_dense masked_scatter masked_select nonzero unique_dim _unique2 "
    "index_copy index_copy_ scatter scatter_ _pin_memory _foreach_copy_ unfold_backward",
    "moves, copies, gathers or creates data: no arithmetic",
)
register_zero("_assert_tensor_metadata _assert_async _assert_scalar _functional_assert_async sym_constrain_range "
              "sym_constrain_range_for_size _print record_stream",
              "a check or annotation: reads metadata, computes nothing")
register_zero("as_strided_ squeeze_ unsqueeze_ t_ transpose_ swapdims_ detach_ _unsafe_set_version_counter",
              "in-place view: changes sizes or strides only")

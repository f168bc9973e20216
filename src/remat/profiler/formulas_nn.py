"""Normalizations, softmax, pooling, reductions, losses and sparse-gradient ops.

Each formula counts elementary operations per element (a transcendental function is one), written
out in its docstring-like ``doc`` so the docs table says exactly what is counted.  N is the number
of elements of the op's input, O of its output.
"""
from __future__ import annotations

from math import prod

from .registry import first_tensor, numel, register

_NORM = "normalization"
_SOFTMAX = "softmax"
_POOL = "pooling and resampling"
_RED = "reductions"
_LOSS = "losses"
_SPARSE = "indexing with arithmetic"


def _mask(output_mask, i: int) -> bool:
    return output_mask is None or bool(output_mask[i])


# --- normalization -------------------------------------------------------------------------------
@register("native_batch_norm _native_batch_norm_legit _native_batch_norm_legit_functional "
          "_batch_norm_with_update _batch_norm_with_update_functional cudnn_batch_norm miopen_batch_norm",
          "training: 4·N statistics (mean; sub, square, add) + 2·N normalize + 2·N affine if weight; "
          "eval: 2·N + affine", group=_NORM)
def batch_norm_flop(x, weight=None, bias=None, running_mean=None, running_var=None, training=True, *args,
                    out_val=None, **kwargs) -> int:
    n = x.numel()
    training = training if isinstance(training, bool) else True  # _batch_norm_with_update: always training
    return (4 * n if training else 0) + 2 * n + (2 * n if weight is not None else 0)


@register("_native_batch_norm_legit_no_training _batch_norm_no_update",
          "2·N normalize + 2·N affine if weight", group=_NORM)
def batch_norm_eval_flop(x, weight=None, *args, out_val=None, **kwargs) -> int:
    return 2 * x.numel() + (2 * x.numel() if weight is not None else 0)


@register("native_batch_norm_backward cudnn_batch_norm_backward miopen_batch_norm_backward batch_norm_backward",
          "grad_input: 7·N training (recompute x̂ 2, two reductions 2, combine 3), 2·N eval; "
          "grad_weight: 2·N (x̂·g, sum); grad_bias: N", group=_NORM)
def batch_norm_backward_flop(grad_out, x, weight=None, running_mean=None, running_var=None, save_mean=None,
                             save_invstd=None, train=True, eps=None, output_mask=None, *args, out_val=None,
                             **kwargs) -> int:
    n = x.numel()
    flops = (7 * n if train else 2 * n) if _mask(output_mask, 0) else 0
    flops += 2 * n if _mask(output_mask, 1) and weight is not None else 0
    flops += n if _mask(output_mask, 2) and weight is not None else 0
    return flops


@register("native_layer_norm native_group_norm",
          "6·N (mean 1; variance 3; normalize 2) + N per affine weight + N per affine bias", group=_NORM)
def layer_norm_flop(x, *args, out_val=None, **kwargs) -> int:
    weight, bias = _norm_affine(args)
    n = x.numel()
    return 6 * n + (n if weight is not None else 0) + (n if bias is not None else 0)


def _norm_affine(args):
    """(weight, bias) of native_layer_norm(x, shape, w, b, eps) or native_group_norm(x, w, b, N, C, ...)."""
    if args and isinstance(args[0], (list, tuple)):  # layer norm: normalized_shape first
        return (args[1] if len(args) > 1 else None), (args[2] if len(args) > 2 else None)
    return (args[0] if args else None), (args[1] if len(args) > 1 else None)


@register("native_layer_norm_backward",
          "grad_input: 7·N (+N if weight); grad_weight: 2·N; grad_bias: N", group=_NORM)
def layer_norm_backward_flop(grad_out, x, normalized_shape, mean, rstd, weight=None, bias=None,
                             output_mask=None, *args, out_val=None, **kwargs) -> int:
    n = x.numel()
    flops = (7 * n + (n if weight is not None else 0)) if _mask(output_mask, 0) else 0
    flops += 2 * n if _mask(output_mask, 1) and weight is not None else 0
    flops += n if _mask(output_mask, 2) and bias is not None else 0
    return flops


@register("native_group_norm_backward",
          "grad_input: 7·N (+N if weight); grad_weight: 2·N; grad_bias: N", group=_NORM)
def group_norm_backward_flop(grad_out, x, mean, rstd, weight=None, *args, out_val=None, **kwargs) -> int:
    output_mask = args[-1] if args and isinstance(args[-1], (list, tuple)) else None
    n = x.numel()
    flops = (7 * n + (n if weight is not None else 0)) if _mask(output_mask, 0) else 0
    flops += 2 * n if _mask(output_mask, 1) and weight is not None else 0
    flops += n if _mask(output_mask, 2) and weight is not None else 0
    return flops


@register("_fused_rms_norm", "4·N (square, mean, rsqrt·x) + N if weight", group=_NORM)
def rms_norm_flop(x, normalized_shape, weight=None, *args, out_val=None, **kwargs) -> int:
    return 4 * x.numel() + (x.numel() if weight is not None else 0)


@register("_fused_rms_norm_backward", "grad_input: 5·N (+N if weight); grad_weight: 2·N", group=_NORM)
def rms_norm_backward_flop(grad_out, x, normalized_shape, rstd, weight=None, output_mask=None, *args,
                           out_val=None, **kwargs) -> int:
    n = x.numel()
    flops = (5 * n + (n if weight is not None else 0)) if _mask(output_mask, 0) else 0
    return flops + (2 * n if _mask(output_mask, 1) and weight is not None else 0)


# --- softmax -------------------------------------------------------------------------------------
@register("_softmax _log_softmax _safe_softmax _masked_softmax",
          "5·N (max, subtract, exp, sum, divide — or log and subtract for log_softmax)", group=_SOFTMAX)
def softmax_flop(x, *args, out_val=None, **kwargs) -> int:
    return 5 * x.numel()


@register("_softmax_backward_data _log_softmax_backward_data _masked_softmax_backward",
          "4·N (softmax: g·y, sum, subtract, multiply; log_softmax: exp, multiply, sum, subtract)",
          group=_SOFTMAX)
def softmax_backward_flop(grad_out, *args, out_val=None, **kwargs) -> int:
    return 4 * grad_out.numel()


# --- pooling -------------------------------------------------------------------------------------
def _kernel(kernel_size) -> int:
    return prod(kernel_size) if isinstance(kernel_size, (list, tuple)) else int(kernel_size)


@register("max_pool2d_with_indices max_pool3d_with_indices max_pool1d_with_indices",
          "O·prod(kernel) comparisons", group=_POOL)
def max_pool_flop(x, kernel_size, *args, out_val=None, **kwargs) -> int:
    return numel(out_val) * _kernel(kernel_size)


@register("avg_pool2d avg_pool3d", "O·prod(kernel) (kernel−1 adds and one divide per output)", group=_POOL)
def avg_pool_flop(x, kernel_size, *args, out_val=None, **kwargs) -> int:
    return numel(out_val) * _kernel(kernel_size)


@register("avg_pool2d_backward avg_pool3d_backward",
          "numel(grad_output)·prod(kernel) (divide, then add into each window element)", group=_POOL)
def avg_pool_backward_flop(grad_out, x, kernel_size, *args, out_val=None, **kwargs) -> int:
    return grad_out.numel() * _kernel(kernel_size)


@register("max_pool2d_with_indices_backward max_pool3d_with_indices_backward adaptive_max_pool2d_backward "
          "adaptive_max_pool3d_backward upsample_nearest2d_backward upsample_nearest1d_backward "
          "upsample_nearest3d_backward _upsample_nearest_exact2d_backward",
          "numel(grad_output) (one scatter-add per gradient element)", group=_POOL)
def scatter_grad_flop(grad_out, *args, out_val=None, **kwargs) -> int:
    return grad_out.numel()


@register("_adaptive_avg_pool2d _adaptive_avg_pool3d adaptive_max_pool2d adaptive_max_pool3d",
          "N + O (adds or comparisons over the input, one divide per output)", group=_POOL)
def adaptive_pool_flop(x, *args, out_val=None, **kwargs) -> int:
    return x.numel() + numel(out_val)


@register("_adaptive_avg_pool2d_backward _adaptive_avg_pool3d_backward",
          "N (one divide per input gradient element)", group=_POOL)
def adaptive_avg_pool_backward_flop(grad_out, x, *args, out_val=None, **kwargs) -> int:
    return x.numel()


@register("upsample_bilinear2d_backward upsample_bicubic2d_backward upsample_linear1d_backward "
          "upsample_trilinear3d_backward _upsample_bilinear2d_aa_backward",
          "7·numel(grad_output) (4 weighted scatter-adds)", group=_POOL)
def upsample_linear_backward_flop(grad_out, *args, out_val=None, **kwargs) -> int:
    return 7 * grad_out.numel()


@register("col2im", "N (overlapping patches are summed)", group=_POOL)
def col2im_flop(x, *args, out_val=None, **kwargs) -> int:
    return x.numel()


# --- reductions ----------------------------------------------------------------------------------
@register("sum nansum prod amax amin aminmax argmax argmin any all count_nonzero",
          "N (one add, multiply or comparison per input element)", group=_RED)
def reduce_flop(x, *args, out_val=None, **kwargs) -> int:
    return x.numel()


@register("max min", "N for reductions; O for the elementwise two-tensor form", group=_RED)
def max_min_flop(x, *args, out_val=None, **kwargs) -> int:
    return max(x.numel(), numel(out_val))


@register("mean nanmean", "N + O (sum, then one divide per output)", group=_RED)
def mean_flop(x, *args, out_val=None, **kwargs) -> int:
    return x.numel() + numel(out_val)


@register("var std var_mean std_mean",
          "4·N + O (mean 1; subtract, square, add 3; one divide per output; std adds a sqrt per output)",
          group=_RED)
def var_flop(x, *args, out_val=None, **kwargs) -> int:
    return 4 * x.numel() + numel(out_val)


@register("linalg_vector_norm norm", "2·N + O (|x|^p and add per input, root per output)", group=_RED)
def norm_flop(x, *args, out_val=None, **kwargs) -> int:
    return 2 * x.numel() + numel(out_val)


@register("logsumexp", "4·N + O (max, subtract, exp, add per input; log and add per output)", group=_RED)
def logsumexp_flop(x, *args, out_val=None, **kwargs) -> int:
    return 4 * x.numel() + numel(out_val)


def _compare_flops(x, dim: int) -> int:
    size = x.shape[dim] if x.dim() else 1
    return x.numel() * max(1, (size - 1).bit_length())


@register("sort argsort median nanmedian", "N·⌈log2(size along dim)⌉ comparisons", group=_RED)
def sort_flop(x, *args, out_val=None, **kwargs) -> int:
    dim = next((a for a in args if isinstance(a, int) and not isinstance(a, bool)), -1)
    return _compare_flops(x, kwargs.get("dim", dim))


@register("topk kthvalue", "N·⌈log2(size along dim)⌉ comparisons (k comes before dim)", group=_RED)
def select_k_flop(x, k=None, *args, out_val=None, **kwargs) -> int:
    dim = args[0] if args and isinstance(args[0], int) and not isinstance(args[0], bool) else -1
    return _compare_flops(x, kwargs.get("dim", dim))



# --- losses --------------------------------------------------------------------------------------
@register("mse_loss mse_loss_backward", "3·N (subtract, square or scale, reduce or multiply)", group=_LOSS)
def mse_flop(a, *args, out_val=None, **kwargs) -> int:
    return 3 * max(a.numel(), args[0].numel() if args and hasattr(args[0], "numel") else 0)


@register("smooth_l1_loss smooth_l1_loss_backward huber_loss huber_loss_backward l1_loss",
          "4·N (subtract, abs, compare, select/scale)", group=_LOSS)
def smooth_l1_flop(a, *args, out_val=None, **kwargs) -> int:
    return 4 * max(a.numel(), args[0].numel() if args and hasattr(args[0], "numel") else 0)


@register("binary_cross_entropy binary_cross_entropy_backward",
          "6·N (two logs, 1−x, two multiplies, add)", group=_LOSS)
def bce_flop(a, *args, out_val=None, **kwargs) -> int:
    return 6 * max(a.numel(), args[0].numel() if args and hasattr(args[0], "numel") else 0)


@register("binary_cross_entropy_with_logits",
          "8·N (log-sigmoid 4, two multiplies, add, reduce)", group=_LOSS)
def bce_logits_flop(a, *args, out_val=None, **kwargs) -> int:
    return 8 * a.numel()


@register("nll_loss_forward nll_loss2d_forward nll_loss_nd",
          "2·numel(target) (gather, weight and accumulate)", group=_LOSS)
def nll_flop(x, target, *args, out_val=None, **kwargs) -> int:
    return 2 * target.numel()


@register("nll_loss_backward nll_loss2d_backward", "numel(target) (scatter the scaled gradient)", group=_LOSS)
def nll_backward_flop(grad_out, x, target, *args, out_val=None, **kwargs) -> int:
    return target.numel()


# --- indexing with arithmetic --------------------------------------------------------------------
@register("embedding_dense_backward embedding_backward", "numel(grad_output) (accumulate rows)",
          group=_SPARSE)
def embedding_backward_flop(grad_out, *args, out_val=None, **kwargs) -> int:
    return grad_out.numel()


@register("index_put index_put_ _index_put_impl _index_put_impl_",
          "numel(values) adds when accumulate=True, else 0 (a copy)", group=_SPARSE)
def index_put_flop(x, indices, values, accumulate=False, *args, out_val=None, **kwargs) -> int:
    return values.numel() if accumulate else 0


@register("index_add index_add_ scatter_add scatter_add_ scatter_reduce scatter_reduce_ index_reduce "
          "index_reduce_", "numel(source) (one add or reduction per source element)", group=_SPARSE)
def scatter_reduce_flop(x, dim, index, src, *args, out_val=None, **kwargs) -> int:
    t = first_tensor(src)
    return t.numel() if t is not None else index.numel()

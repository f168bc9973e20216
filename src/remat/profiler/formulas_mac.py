"""Matmul, convolution and attention formulas: torch's own, plus the fixes and CPU variants it lacks.

2 FLOPs per multiply-add, exactly as ``torch.utils.flop_counter``.  We reuse its registered
functions unchanged except ``convolution_backward``, whose weight gradient ignores ``groups``
(torch 2.14.1 gives mobilenet_v3_small a backward/forward ratio of 33 instead of about 2).
"""
from __future__ import annotations

from math import prod

import torch
from torch.utils import flop_counter as _fc

from .registry import REGISTRY, Formula, register

aten = torch.ops.aten

_TORCH_DOCS = {
    "mm": "2·m·n·k",
    "addmm": "2·m·n·k (bias add not counted, as torch)",
    "bmm": "2·b·m·n·k",
    "baddbmm": "2·b·m·n·k (as torch)",
    "_scaled_mm": "2·m·n·k",
    "convolution": "2·N·C_out·(C_in/groups)·prod(kernel)·prod(out spatial) (as torch)",
    "_convolution": "as convolution",
    "cudnn_convolution": "as convolution",
    "convolution_overrideable": "as convolution",
    "_slow_conv2d_forward": "as convolution",
    "_scaled_dot_product_efficient_attention": "4·b·h·s_q·s_k·d (QKᵀ and PV; softmax not counted, as torch)",
    "_scaled_dot_product_flash_attention": "as efficient attention",
    "_scaled_dot_product_cudnn_attention": "as efficient attention",
    "_scaled_dot_product_efficient_attention_backward": "10·b·h·s_q·s_k·d (recomputed QKᵀ + 4 matmuls, as torch)",
    "_scaled_dot_product_flash_attention_backward": "as efficient attention backward",
    "_scaled_dot_product_cudnn_attention_backward": "as efficient attention backward",
    "_flash_attention_forward": "as sdpa forward, per sequence for nested inputs",
    "_efficient_attention_forward": "as sdpa forward, per sequence for nested inputs",
    "_flash_attention_backward": "as sdpa backward, per sequence for nested inputs",
    "_efficient_attention_backward": "as sdpa backward, per sequence for nested inputs",
}

# torch's registry, taken as it is (the conv backward entry is replaced below).
for _packet, _fn in _fc.flop_registry.items():
    if isinstance(_packet, torch._ops.OpOverloadPacket) and _packet.__name__ in _TORCH_DOCS:
        REGISTRY[_packet] = Formula(_fn, _TORCH_DOCS[_packet.__name__], True, "matmul, convolution, attention")

# The aten ops FlopCounterMode counts; benchmarks and tests compare on these.
TORCH_COVERED = frozenset(p for p in _fc.flop_registry if isinstance(p, torch._ops.OpOverloadPacket))

_GROUP = "matmul, convolution, attention"


def _t(shape):
    return [shape[1], shape[0], *shape[2:]]


@register("convolution_backward",
          "grad_input: as the forward conv; grad_weight: 2·N·C_out·(C_in/groups)·prod(kernel)·prod(out "
          "spatial) (torch's formula divided by groups, the fix)", mac=True, group=_GROUP)
@_fc.shape_wrapper
def conv_backward_flop(grad_out_shape, x_shape, w_shape, _bias, _stride, _padding, _dilation, transposed,
                       _output_padding, groups, output_mask, out_shape=None, **kwargs) -> int:
    flops = 0
    if output_mask[0]:
        flops += _fc.conv_flop_count(grad_out_shape, w_shape, out_shape[0], not transposed)
    if output_mask[1]:
        if transposed:
            weight = _fc.conv_flop_count(_t(grad_out_shape), _t(x_shape), _t(out_shape[1]), transposed=False)
        else:
            weight = _fc.conv_flop_count(_t(x_shape), _t(grad_out_shape), _t(out_shape[1]), transposed=False)
        # torch's count multiplies every input channel with every output channel; a grouped
        # convolution only pairs channels within a group.
        flops += weight // groups
    return flops


@register("_scaled_dot_product_flash_attention_for_cpu _scaled_dot_product_fused_attention_overrideable",
          "4·b·h·s_q·s_k·d (QKᵀ and PV, as torch's sdpa)", mac=True, group=_GROUP)
@_fc.shape_wrapper
def sdpa_cpu_flop(q, k, v, *args, out_shape=None, **kwargs) -> int:
    return _fc.sdpa_flop_count(q, k, v)


@register("_scaled_dot_product_flash_attention_for_cpu_backward",
          "10·b·h·s_q·s_k·d (as torch's sdpa backward)", mac=True, group=_GROUP)
@_fc.shape_wrapper
def sdpa_cpu_backward_flop(grad_out, q, k, v, *args, out_shape=None, **kwargs) -> int:
    return _fc.sdpa_backward_flop_count(grad_out, q, k, v)


@register("mv addmv", "2·m·n", mac=True, group=_GROUP)
def mv_flop(*args, out_val=None, **kwargs) -> int:
    mat = args[1] if args[0].dim() == 1 and len(args) > 2 else args[0]
    return 2 * mat.shape[0] * mat.shape[1]


@register("dot vdot", "2·n", mac=True, group=_GROUP)
def dot_flop(a, b, *args, out_val=None, **kwargs) -> int:
    return 2 * a.numel()


@register("addbmm", "2·b·m·n·k", mac=True, group=_GROUP)
def addbmm_flop(_self, a, b, *args, out_val=None, **kwargs) -> int:
    return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]


@register("_int_mm", "2·m·n·k", mac=True, group=_GROUP)
def int_mm_flop(a, b, *args, out_val=None, **kwargs) -> int:
    return 2 * a.shape[0] * a.shape[1] * b.shape[1]


@register("_embedding_bag", "1 per gathered element (bag reduction adds)", group="reductions")
def embedding_bag_flop(weight, indices, *args, out_val=None, **kwargs) -> int:
    return indices.numel() * prod(weight.shape[1:])


# oneDNN's fused RNN layer (CPU LSTM): the input and hidden matmuls of every gate at every step;
# the gate arithmetic is not counted (as torch does not count attention's softmax).
def _rnn_matmul_flops(x, w_ih, w_hh) -> int:
    steps_by_batch = x.numel() // x.shape[-1]
    return 2 * steps_by_batch * w_ih.shape[0] * (w_ih.shape[1] + w_hh.shape[1])


@register("mkldnn_rnn_layer", "2·T·B·G·(I+H): input and hidden matmuls, G = rows of the gate weights",
          mac=True, group=_GROUP)
def mkldnn_rnn_layer_flop(x, w_ih, w_hh, *args, out_val=None, **kwargs) -> int:
    return _rnn_matmul_flops(x, w_ih, w_hh)


@register("mkldnn_rnn_layer_backward", "2× the forward's: gradients of the inputs and of the weights",
          mac=True, group=_GROUP)
def mkldnn_rnn_layer_backward_flop(x, w_ih, w_hh, *args, out_val=None, **kwargs) -> int:
    return 2 * _rnn_matmul_flops(x, w_ih, w_hh)

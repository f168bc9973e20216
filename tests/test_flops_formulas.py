"""Each formula against a hand computation, and unknown ops reported instead of silently zero."""
import pytest
import torch
import torch.nn.functional as F

import remat


def test_grouped_conv_forward_and_backward():
    n, cin, cout, groups, k, hw = 2, 8, 16, 4, 3, 10
    conv = torch.nn.Conv2d(cin, cout, k, padding=1, groups=groups, bias=False)
    x = torch.randn(n, cin, hw, hw, requires_grad=True)
    c = remat.count_flops(conv, (x,))
    macs = n * cout * (cin // groups) * k * k * hw * hw  # every output element: C_in/groups * k*k MACs
    assert c.fwd_by_op["aten.convolution"] == 2 * macs
    # grad_input is a transposed conv with the same MACs; grad_weight pairs channels within groups only.
    assert c.bwd_by_op["aten.convolution_backward"] == 2 * macs + 2 * macs
    assert c.fwd_macs == macs and c.bwd_macs == 2 * macs


def test_depthwise_conv_weight_grad_only():
    conv = torch.nn.Conv2d(32, 32, 3, padding=1, groups=32, bias=False)
    x = torch.randn(1, 32, 7, 7)  # no input grad: only the weight gradient is computed
    c = remat.count_flops(conv, (x,))
    assert c.bwd_by_op["aten.convolution_backward"] == c.fwd_by_op["aten.convolution"] == 2 * 32 * 9 * 49


def test_bmm_and_baddbmm():
    b, m, k, n = 3, 4, 5, 6
    a = torch.randn(b, m, k, requires_grad=True)
    w = torch.randn(b, k, n, requires_grad=True)
    c = remat.count_flops(torch.bmm, (a, w))
    assert c.fwd_by_op == {"aten.bmm": 2 * b * m * n * k}
    assert c.bwd_by_op["aten.bmm"] == 2 * (2 * b * m * n * k)  # grad_a and grad_w
    bias = torch.randn(b, m, n)
    c = remat.count_flops(torch.baddbmm, (bias, a, w))
    assert c.fwd_by_op["aten.baddbmm"] == 2 * b * m * n * k


def test_sdpa_cpu_flash_kernel():
    b, h, s, d = 2, 3, 16, 8
    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
    c = remat.count_flops(F.scaled_dot_product_attention, (q, k, v))
    assert c.fwd_by_op == {"aten._scaled_dot_product_flash_attention_for_cpu": 4 * b * h * s * s * d}
    assert c.bwd_by_op["aten._scaled_dot_product_flash_attention_for_cpu_backward"] == 10 * b * h * s * s * d


def test_layer_norm_and_softmax():
    x = torch.randn(4, 10, 32, requires_grad=True)
    ln = torch.nn.LayerNorm(32)
    c = remat.count_flops(ln, (x,))
    n = x.numel()
    assert c.fwd_by_op == {"aten.native_layer_norm": 6 * n + n + n}
    assert c.bwd_by_op["aten.native_layer_norm_backward"] == (7 * n + n) + 2 * n + n
    c = remat.count_flops(lambda t: torch.softmax(t, -1), (x,))
    assert c.fwd_by_op == {"aten._softmax": 5 * n}
    assert c.bwd_by_op["aten._softmax_backward_data"] == 4 * n


def test_elementwise_and_inplace_share_a_formula():
    x = torch.randn(5, 7)
    c = remat.count_flops(lambda t: (t * 2).relu_() + t.sigmoid(), (x,))
    assert c.fwd_by_op == {"aten.mul": 35, "aten.relu_": 35, "aten.sigmoid": 4 * 35, "aten.add": 35}
    assert c.bwd == 0  # nothing requires grad


def test_views_and_copies_are_zero_and_not_unknown():
    x = torch.randn(4, 6, requires_grad=True)
    c = remat.count_flops(lambda t: torch.cat([t.t().contiguous().view(-1), t[1:].reshape(-1)]), (x,))
    assert c.fwd == 0 and c.unknown_ops == {}


def test_unknown_op_is_reported_never_silently_zero():
    x = torch.randn(4, 16, requires_grad=True)
    with pytest.warns(remat.RematWarning, match="no FLOP formula for aten._fft_r2c"):
        c = remat.count_flops(lambda t: torch.fft.rfft(t).abs(), (x,))
    assert any("fft" in op for op in c.unknown_ops), c.unknown_ops
    assert c.fwd_by_op["aten._fft_r2c"] == 4 * 16  # conservative estimate: its largest tensor's elements


def test_fwd_equals_flop_counter_mode_on_covered_ops():
    torchvision = pytest.importorskip("torchvision")
    from torch.utils.flop_counter import FlopCounterMode

    model = torchvision.models.resnet18()
    x = torch.randn(2, 3, 64, 64)
    ours = remat.count_flops(model, (x,))
    with FlopCounterMode(display=False) as ref:
        model(x).sum().backward()
    theirs = {str(k): v for k, v in ref.get_flop_counts()["Global"].items()}
    covered_ours = {k: v for k, v in {**ours.fwd_by_op}.items() if k in theirs}
    bwd_ours = {k: v for k, v in ours.bwd_by_op.items() if k in theirs}
    total = {k: covered_ours.get(k, 0) + bwd_ours.get(k, 0) for k in theirs}
    assert total == theirs  # resnet18 has no grouped convolutions: same counts op by op


def test_selection_counts_comparisons_along_its_dim_not_k():
    """topk/kthvalue take k before dim: a k of 2 on a 2-D input was read as dim 2 (an IndexError
    inside the profile of Mixtral's router)."""
    x = torch.randn(6, 8)
    c = remat.count_flops(lambda t: torch.topk(t, 2)[0] + torch.kthvalue(t, 3, 0)[0].sum(), (x,))
    assert c.fwd_by_op["aten.topk"] == 48 * 3  # 8 along the last dim: ceil(log2 8) = 3
    assert c.fwd_by_op["aten.kthvalue"] == 48 * 3  # 6 along dim 0: ceil(log2 6) = 3
    c = remat.count_flops(lambda t: torch.msort(t), (torch.randn(5, 3),))
    assert c.fwd_by_op == {"aten.sort": 15 * 3}  # msort runs sort along dim 0: 5 there


def test_a_second_formula_for_one_op_is_refused():
    """As torch's flop_counter: registering over an op's formula would silently change counts."""
    from remat.profiler.registry import register

    with pytest.raises(RuntimeError, match="already has a FLOP formula"):
        register("mm", "a second mm formula", mac=True, group="test")(lambda *a: 0)

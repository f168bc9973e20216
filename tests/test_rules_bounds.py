"""The memory rules are upper bounds: with scratch from the rules alone (``calibrate=False``, what
inputs on meta or another device get) the predicted step peak is at least the measured one.

One representative per kernel family whose rules once under-predicted (benchmarks/opfuzz.py
--scratch rules, benchmarks/rules_gap.py): each configuration here was under-predicted by 30-90 %
before its rule existed.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import remat
from remat.testing import assert_predicted


class Summed(nn.Module):
    """``module(x)``, its first output when it returns several (an LSTM's)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.module(x)
        return y[0] if isinstance(y, tuple) else y


def _cases() -> dict[str, tuple[nn.Module, torch.Tensor]]:
    return {
        # gemm-based oneDNN path: im2col per thread, not the direct kernel the oneDNN scans measured
        "conv2d_dilated": (nn.Conv2d(32, 48, 5, stride=2, dilation=3, padding=6), torch.randn(2, 32, 40, 8)),
        # bf16 3-D: computed in fp32 by oneDNN's reference/gemm kernels
        "conv3d_bf16": (nn.Conv3d(8, 16, 3, padding=1).to(torch.bfloat16),
                        torch.randn(2, 8, 10, 12, 12, dtype=torch.bfloat16, requires_grad=True)),
        # backward copies the expanded gradient of .sum() and the indices to the input's layout
        "maxpool2d_backward": (nn.MaxPool2d(2), torch.randn(4, 64, 48, 48)
                               .contiguous(memory_format=torch.channels_last).requires_grad_()),
        # dense gradient copy, index buffers and the weight gradient
        "embedding": (nn.Embedding(5000, 256), torch.randint(0, 5000, (8, 128))),
        # oneDNN's workspace lives from the forward to the backward
        "lstm": (nn.LSTM(16, 32, batch_first=True), torch.randn(2, 12, 16, requires_grad=True)),
        # a permuted (neither contiguous nor channels-last) input is copied contiguous first
        "group_norm_permuted": (nn.GroupNorm(472, 472, affine=False), torch.randn(385, 472, 2).permute(2, 1, 0)),
        # max mode gathers the maxima's indices and gradient rows of every non-empty bag
        "embedding_bag_max": (nn.EmbeddingBag(50, 300, mode="max"), torch.randint(0, 50, (200, 2))),
        # a frozen weight with a bias: the bias gradient runs the weight gradient's primitive
        "conv_bias_only_grad": (_frozen(nn.Conv2d(3, 158, 7, stride=2, padding=(30, 12), dilation=10)),
                                torch.randn(3, 3, 52, 38)),
        # a transposed convolution on few channels: operands in the blocked layout (padded to 16)
        "conv_transpose_few_channels": (nn.ConvTranspose2d(1, 1, 3, padding=(0, 1)),
                                        torch.randn(6, 1, 61, 64).contiguous(memory_format=torch.channels_last)
                                        .requires_grad_()),
        # a grouped convolution on few channels: the source reordered to the blocked layout anyway
        "conv_grouped_few_channels": (nn.Conv2d(2, 2, 7, stride=3, padding=(2, 3), groups=2, bias=False),
                                      torch.randn(6, 2, 27, 51)),
    }


def _frozen(module: nn.Module) -> nn.Module:
    module.weight.requires_grad_(False)
    return module


# The bf16 conv3d bound assumes oneDNN's reference/gemm kernels computing in fp32 (rules/cpu_conv.py:
# gemm_bound).  How far the real kernel stays below depends on the CPU: the step peaked at ~820 KB
# (12x under the bound) on the machine the rule was checked on, at 418,892 B (23.5x under) on an
# AMD EPYC with AVX-512 bf16 (2026-12-04), whose kernel keeps the bf16 operands.
LOOSEST = {"conv3d_bf16": 32}


@pytest.mark.parametrize("name", list(_cases()))
def test_rules_only_prediction_is_an_upper_bound(name: str) -> None:
    module, x = _cases()[name]
    model = Summed(module).train()
    predicted = remat.profile(model, (x,), calibrate=False).peak_bytes
    x.grad = None
    measured = remat.measure_peak(model, (x,))
    assert predicted >= measured, f"{name}: rules predict {predicted} B, the step peaks at {measured} B"
    # a bound, not a useless one (the convolution bounds cover kernels they cannot tell apart, at a
    # price on small convolutions)
    assert predicted <= LOOSEST.get(name, 16) * measured, f"{name}: rules predict {predicted} B for a {measured} B peak"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scratch_that_depends_on_index_values_is_bounded_when_measured(dtype: torch.dtype) -> None:
    """Calibration runs ops on zero indices; EmbeddingBag's max-mode backward then sees every bag
    empty and allocates almost nothing, while a real step with its bags filled gathers 10-16 B per
    bag and column (benchmarks/opfuzz.py seed 1503: predicted 28 % low before the rule's value_bound)."""
    model = Summed(nn.EmbeddingBag(50, 300, mode="max").to(dtype)).train()
    x = torch.randint(0, 50, (200, 2))
    predicted = remat.profile(model, (x,)).peak_bytes
    measured = remat.measure_peak(model, (x,))
    assert_predicted(predicted, measured, what=f"EmbeddingBag max {dtype}")


def _layouts(shape: tuple[int, ...]):
    """An input of ``shape`` in each layout a model hands a kernel: contiguous, channels-last (4-D,
    5-D), permuted, sliced."""
    yield "contiguous", torch.randn(shape)
    if len(shape) in (4, 5):
        fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
        yield "channels-last", torch.randn(shape).contiguous(memory_format=fmt)
    order = (*range(1, len(shape)), 0)
    yield "permuted", torch.randn([shape[i] for i in order]).permute([order.index(i) for i in range(len(shape))])
    yield "sliced", torch.randn(*shape[:-1], 2 * shape[-1])[..., ::2]


@pytest.mark.parametrize("shape", [(6, 5), (4, 5, 7), (3, 5, 6, 7), (2, 5, 3, 4, 6)], ids=["1d-flat", "1d", "2d", "3d"])
def test_batch_norm_outputs_are_laid_out_as_the_cpu_kernels_lay_them_out(shape: tuple[int, ...]) -> None:
    """The fake kernels keep a permuted input's strides (forward) or the gradient's (backward); the
    CPU kernels use the input's suggested memory format. The layout decides what autograd copies."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from remat.profiler.rules import rules_for

    aten = torch.ops.aten
    c = shape[1]

    def run(x, g):
        w, b, rm, rv = torch.randn(c), torch.randn(c), torch.zeros(c), torch.ones(c)
        fwd = aten.native_batch_norm.default(x, w, b, rm, rv, True, 0.1, 1e-5)
        bwd = aten.native_batch_norm_backward.default(g, x, w, rm, rv, fwd[1], fwd[2], True, 1e-5, [True, True, True])
        return fwd, bwd, (x, w, b, rm, rv, True, 0.1, 1e-5), (g, x)

    def laid_out(op, args, out):
        for r in rules_for(op, "cpu"):
            if r.layout is not None:
                out = r.layout(args, out)
        return out[0].stride()

    for name, x in _layouts(shape):
        for gname, g in _layouts(shape):
            real_fwd, real_bwd, _, _ = run(x, g)
            with FakeTensorMode() as mode:
                fwd, bwd, fargs, bargs = run(mode.from_tensor(x), mode.from_tensor(g))
                got_fwd = laid_out(aten.native_batch_norm.default, fargs, fwd)
                got_bwd = laid_out(aten.native_batch_norm_backward.default, bargs, bwd)
            assert got_fwd == real_fwd[0].stride(), (name, "forward")
            assert got_bwd == real_bwd[0].stride(), (name, gname, "backward")


class _Recorder:
    """Measured kernel memory per op, with the rules' answer for the same call beside it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def calibration_for(self, target, tensors, enabled=None):
        from remat.profiler.calibrate import Calibration, calibration_for
        from remat.profiler.dispatch import RuleScratch

        calls = self.calls
        base = calibration_for(target, tensors, True)

        class Compare(Calibration):
            def kernel(self, func, args, kwargs, out, rules, ctx):
                got = super().kernel(func, args, kwargs, out, rules, ctx)
                calls.append((str(func), got.scratch + got.extra_out,
                              RuleScratch().kernel(func, args, kwargs, out, rules, ctx).scratch))
                return got

        return Compare(base.target, base.limit_bytes)


@pytest.mark.parametrize("name", ["conv_bias_only_grad", "conv_transpose_few_channels", "conv_grouped_few_channels"])
def test_each_convolution_rule_bounds_its_measured_kernel(name: str, monkeypatch) -> None:
    """Op by op (the step peak can hide a kernel, as the bias-only backward's 1 MB under a larger
    forward): every convolution call's rule scratch is at least what the kernel measured here."""
    import remat.profiled as problem

    recorder = _Recorder()
    monkeypatch.setattr(problem, "calibration_for", recorder.calibration_for)
    module, x = _cases()[name]
    remat.profile(Summed(module).train(), (x,))
    convs = [c for c in recorder.calls if "convolution" in c[0]]
    assert convs
    for op, measured, rule in convs:
        assert rule >= measured, f"{name}: {op} measured {measured} B, the rule says {rule} B"

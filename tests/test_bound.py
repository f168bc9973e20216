"""The checkpointing bound (profiler/bound.py) is a lower bound: no plan's real step, remat's or
checkpoints placed by hand, measures below it, and budgets under it say so."""
import random

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

import remat
from remat.testing.patterns import Recurrent
from remat.zoo import build


def _net(rng: random.Random) -> nn.Sequential:
    layers: list[nn.Module] = []
    c = 3
    for _ in range(rng.randint(3, 8)):
        out = rng.choice([8, 16, 24])
        layers += [nn.Conv2d(c, out, rng.choice([1, 3]), padding="same"),
                   rng.choice([nn.BatchNorm2d(out), nn.ReLU(), nn.GELU(), nn.Identity()])]
        c = out
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 10)).train()


def _hand_checkpointed(model: nn.Sequential, segments: int) -> nn.Module:
    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, x):
            return checkpoint_sequential(self.inner, segments, x, use_reentrant=False)
    return Wrapped()


@pytest.mark.parametrize("seed", range(4))
def test_no_hand_placed_checkpointing_measures_below_the_bound(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model = _net(rng)
    x = torch.randn(rng.choice([4, 8]), 3, rng.choice([24, 32]), rng.choice([24, 32]))
    bound = remat.profile(model, (x,)).bound
    fixed = remat.profile(model, (x,)).resident_bytes + sum(p.numel() * 4 for p in model.parameters())
    assert bound.bytes > fixed, "an op of a conv net needs more than its parameters and gradients"
    for segments in {1, 2, len(model) // 2, len(model)}:
        measured = remat.measure_peak(_hand_checkpointed(model, segments), (x,))
        assert measured >= bound.bytes, (segments, measured, bound)


def test_a_budget_under_the_bound_says_no_plan_of_any_kind_fits():
    rng = random.Random(7)
    model = _net(rng)
    x = torch.randn(8, 3, 32, 32)
    bound = remat.profile(model, (x,)).bound
    with pytest.raises(remat.InfeasibleBudget, match="No checkpointing of this model's code, remat's or by hand") as info:
        remat.checkpoint(model, (x,), budget=bound.bytes - 1)
    assert info.value.bound_bytes == bound.bytes
    assert info.value.min_bytes >= bound.bytes
    gm = remat.checkpoint(model, (x,), budget="min")
    assert remat.measure_peak(gm, (x,)) >= bound.bytes


@pytest.mark.slow
def test_an_lm_heads_backward_sets_the_bound_every_plan_stays_above():
    """GPT-2's tied LM head: one op of the backward (the weight gradient's matmul, which materializes
    the logits' expanded gradient, or the sum of the tied weight's two gradients) needs more than
    parameters and gradients; transformers' own checkpointing of every block, the model as is, and
    remat's floor all measure at or above the bound."""
    work = build("transformers:gpt2:layers=2,width=128,heads=4,seq=64", 2)
    prof = remat.profile(work.model, work.inputs)
    bound = prof.bound
    assert "backward" in bound.reason and bound.bytes > prof.resident_bytes + prof.grad_bytes
    floor = remat.checkpoint(work.model, work.inputs, budget="min")
    blocks = build("transformers:gpt2:layers=2,width=128,heads=4,seq=64", 2).model
    blocks.load_state_dict(work.model.state_dict())
    blocks.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for module in (work.model, blocks, floor):
        assert remat.measure_peak(module, work.inputs) >= bound.bytes


@pytest.mark.parametrize("layer, shape", [
    (lambda: nn.Conv2d(16, 32, 3, padding=1), (8, 16, 32, 32)),
    (lambda: nn.Conv2d(16, 16, 5, stride=2), (4, 16, 40, 40)),
    (lambda: nn.Linear(256, 512), (64, 256)),
    (lambda: nn.Linear(512, 64), (32, 16, 512)),
])
@pytest.mark.parametrize("input_grad", [False, True])
def test_the_bound_of_a_one_op_model_is_its_measured_peak(layer, shape, input_grad):
    """With one op, nothing but that op's tensors is ever alive above the resident bytes: the bound
    is exact there (so it counts no storage twice and misses none)."""
    torch.manual_seed(0)
    model = layer()
    x = torch.randn(*shape, requires_grad=input_grad)
    bound = remat.profile(model, (x,)).bound
    x.grad = None
    assert bound.bytes == remat.measure_peak(model, (x,)), bound


class _InplaceResidual(nn.Module):
    """``y = x * s; y += x``, behind a branch on a shape (symbolic_trace fails, export traces it)."""

    def __init__(self, branch: bool) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.branch = branch

    def forward(self, x):
        if self.branch and x.shape[0] > 1:
            y = x * self.scale
            y += x
            return y
        y = x * self.scale
        y += x
        return y


@pytest.mark.parametrize("branch, frontend", [(False, "symbolic_trace"), (True, "export")])
def test_an_inplace_add_stays_in_place_in_the_trace_the_bound_is_taken_on(branch, frontend):
    """The bound is computed on the trace but claimed for the model's own code: it holds because
    both frontends keep what the model runs in place in place (an out-of-place add would put one
    more tensor in the trace's step, and the bound above the model's own measured peak)."""
    model = _InplaceResidual(branch)
    x = torch.randn(64, 1024)
    prof = remat.profile(model, (x,))
    assert prof.frontend == frontend
    measured = remat.measure_peak(model, (x,))
    assert prof.peak_bytes == measured
    assert prof.bound.bytes <= measured


def test_a_peak_inside_one_op_is_named_not_blamed_on_the_parameters():
    """An LSTM is one graph node: its backward's working set is the step's peak, far above the
    parameters and gradients, and no checkpoint splits it.  The error says so and names the op."""
    x = torch.randint(0, 100, (16, 64))
    with pytest.raises(remat.InfeasibleBudget, match="inside one op or graph node no checkpoint splits") as info:
        remat.checkpoint(Recurrent(), (x,), budget=0.5)
    err = info.value
    assert err.min_fraction == 1.0
    assert "rnn" in str(err).split("bound_bytes")[-1], "the bound names the recurrent op's backward"
    assert err.bound_bytes <= err.min_bytes <= remat.measure_peak(Recurrent(), (x,)) + 64

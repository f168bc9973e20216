"""Inputs people really pass: one training step of the checkpointed module against the original."""
import contextlib
import dataclasses
import importlib
import re
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import remat

from conftest import remat_env
from models import DictOutput, MultiOutput, SharedParams, ViewsAndInplace
from remat.testing import assert_same_step


def make(model, inputs, kwargs=None, solver="every-stage"):
    return lambda m: remat.checkpoint(m, inputs, kwargs, solver=solver)


class KwargsModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x, scale: float = 1.0, mask=None, use_b: bool = True):
        h = torch.relu(self.a(x)) * scale
        if mask is not None:
            h = h * mask
        return self.b(h) if use_b else h


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    hidden: torch.Tensor


class DataclassOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return Out(self.b(h), h)


class Frozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 4)
        for p in self.backbone.parameters():
            p.requires_grad_(False)

    def forward(self, x):
        return self.head(self.backbone(x) + 1)


class InplaceOnInputView(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)

    def forward(self, x):
        y = x.clone()
        y[:, :4].mul_(2)  # in place on a view of a copy of the input
        return self.a(y).relu_() + y


def test_kwargs_and_non_tensor_arguments():
    x, mask = torch.randn(4, 16), (torch.rand(4, 32) > 0.5).float()
    kwargs = {"scale": 0.5, "mask": mask, "use_b": True}
    gm = assert_same_step(KwargsModel(), make(None, (x,), kwargs), (x,), kwargs=kwargs)
    assert gm.remat_plan.regions


def test_tuple_dict_and_dataclass_outputs():
    x = torch.randn(4, 3, 16, 16)
    assert_same_step(MultiOutput(), make(None, (x,)), (x,))
    y = torch.randn(8, 32)
    assert_same_step(DictOutput(), make(None, (y,)), (y,))
    z = torch.randn(5, 8)
    assert_same_step(DataclassOut(), make(None, (z,)), (z,))


def test_integer_inputs_and_tied_parameters():
    ids = torch.randint(0, 100, (4, 12))
    assert_same_step(SharedParams(), make(None, (ids,)), (ids,))


def test_frozen_parameters():
    x = torch.randn(8, 16)
    gm = assert_same_step(Frozen(), make(None, (x,)), (x,))
    assert all(not p.requires_grad for p in gm.backbone.parameters())


def test_eval_mode():
    torchvision = pytest.importorskip("torchvision")
    model = torchvision.models.resnet18().eval()
    x = torch.randn(2, 3, 32, 32)
    assert_same_step(model, make(None, (x,)), (x,))


def test_inputs_that_require_grad():
    x = torch.randn(4, 64, requires_grad=True)
    model = ViewsAndInplace()
    ref = model(x).sum()
    (gx,) = torch.autograd.grad(ref, x)
    gm = remat.checkpoint(model, (x,), solver="every-stage")
    (gx2,) = torch.autograd.grad(gm(x).sum(), x)
    torch.testing.assert_close(gx2, gx)


def test_inplace_on_views_of_inputs():
    x = torch.randn(4, 16)
    assert_same_step(InplaceOnInputView(), make(None, (x,)), (x,))


def test_bf16_autocast_on_cpu():
    x = torch.randn(8, 16)
    model = KwargsModel()

    def run(m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(x)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        gm = remat.checkpoint(model, (x,), solver="every-stage")
    torch.manual_seed(0)
    ref = run(model)
    ref.float().sum().backward()
    ref_grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    got = run(gm)
    got.float().sum().backward()
    torch.testing.assert_close(got, ref)
    for k, p in gm.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[k])


def test_public_functions_never_modify_the_model():
    torchvision = pytest.importorskip("torchvision")
    model = torchvision.models.resnet18()
    x = torch.randn(2, 3, 32, 32)
    before = {k: (v.data_ptr(), v.clone()) for k, v in model.state_dict().items()}
    remat.count_flops(model, (x,))
    remat.profile(model, (x,))
    remat.measure_peak(model, (x,))
    remat.checkpoint(model, (x,), solver="chen-sqrtn")
    for k, v in model.state_dict().items():
        assert v.data_ptr() == before[k][0] and torch.equal(v, before[k][1]), k
    assert all(p.grad is None for p in model.parameters())
    assert model.training


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent Python control flow: neither frontend can trace it
            return self.a(x)
        return -x


def test_untraceable_model_is_a_trace_error_naming_the_line():
    with pytest.raises(remat.TraceError, match=r"if x.sum\(\) > 0") as info:
        remat.checkpoint(DataDependent(), (torch.randn(2, 4),), budget=0.5)
    assert "symbolic_trace failed" in str(info.value) and "torch.export failed" in str(info.value)
    assert "Try:" in str(info.value)


def test_internal_errors_are_reported_as_remat_bugs(monkeypatch):
    import remat.planner.problem
    import remat.planner.search

    def broken(model, max_stages, depths=None):
        return remat.planner.search._expand((remat.Region(0, 1),), [])  # an IndexError inside remat's own code

    monkeypatch.setattr(remat.planner.problem, "coarsen", broken)
    with pytest.raises(remat.InternalError, match="bug in remat"):
        remat.checkpoint(KwargsModel(), (torch.randn(2, 16),), budget=0.5)


class RaisesKeyError(nn.Module):
    def forward(self, x):
        return {}["missing"]


def test_errors_of_the_users_model_are_not_disguised():
    with pytest.raises(KeyError, match="missing"):
        remat.measure_peak(RaisesKeyError(), (torch.randn(2),))


@pytest.mark.parametrize("frontend", ["symbolic_trace", "export"])
def test_a_call_under_another_autocast_than_planned_is_refused_or_warned(monkeypatch, frontend):
    """The plan is for the autocast around the planned call.  A torch.export graph asserts the
    planned dtypes: called under another autocast it failed inside the graph with "Tensor dtype
    mismatch! Expected: Float, Got: c10::BFloat16"; now a ShapeError says why and what to do.  A
    symbolic trace runs, with a warning that the budget may not hold (bf16 planned, fp32 run: twice
    the activations)."""
    import importlib

    trace = importlib.import_module("remat.trace")  # (remat.trace is the function)
    monkeypatch.setattr(trace, "FRONTENDS", {frontend: trace.FRONTENDS[frontend]})
    x = torch.randn(8, 16)
    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    mlp = lambda: nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))  # noqa: E731
    plain = remat.checkpoint(mlp(), (x,), solver="every-stage")
    with bf16():
        mixed = remat.checkpoint(mlp(), (x,), solver="every-stage")
    assert plain.remat_frontend == mixed.remat_frontend == frontend
    for gm, around, said in ((plain, bf16, "planned without autocast and this call runs under torch.autocast"),
                             (mixed, contextlib.nullcontext, "planned under torch.autocast('cpu', dtype=torch."
                                                             "bfloat16) and this call runs without")):
        with around():
            if frontend == "export":
                with pytest.raises(remat.ShapeError, match=re.escape(said)):
                    gm(x)
            else:
                with pytest.warns(remat.RematWarning, match=re.escape(said)):
                    gm(x)
        with (bf16() if gm is mixed else contextlib.nullcontext()), warnings.catch_warnings():
            warnings.simplefilter("error", remat.RematWarning)
            gm(x)  # as planned: no word


def test_checkpoint_in_place_runs_the_original_forward_under_another_autocast(monkeypatch):
    monkeypatch.setattr(importlib.import_module("remat.trace"), "FRONTENDS",
                        {"export": importlib.import_module("remat.trace").FRONTENDS["export"]})
    x = torch.randn(8, 16)
    model = remat.checkpoint_(KwargsModel(), (x,), solver="every-stage")
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.warns(remat.RematWarning, match="original forward"):
        out = model(x)
    assert out.dtype == torch.bfloat16


def test_planning_leaves_the_random_stream_as_it_was(tmp_path):
    """With a cold cache, measuring the machine drew its test matrices from torch's global
    generator: the first step after planning (checkpoint_ plans inside it) drew other dropout masks
    than the same step without remat, so a run's losses depended on what the cache held."""
    code = ("import torch, remat\n"
            "from remat.zoo import ResidualMLP\n"
            "model, x = ResidualMLP(width=64, depth=4, p=0.2), torch.randn(256, 64)\n"
            "torch.manual_seed(1)\n"
            "remat.checkpoint(model, (x,), budget='min')\n"
            "after = torch.rand(3)\n"
            "torch.manual_seed(1)\n"
            "print(torch.equal(after, torch.rand(3)))\n")
    env = remat_env(REMAT_CACHE_DIR=str(tmp_path))  # a cold cache: the machine is measured
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"
    assert list(tmp_path.glob("machine-*cpu-*")), "the machine was not measured: the test checks nothing"

"""The trace is checked before planning: grad modes, autocast, the model's own checkpoints, random
ops and other input shapes all survive into the checkpointed module."""
import contextlib
import importlib
import pickle

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as cp
from torch import nn

import remat

from remat.testing import assert_same_step, train_step
from remat.testing.patterns import Hooked, KeyQueue


class FrozenFeatures(nn.Module):
    """The issue's minimal case: a frozen extractor and a stop-gradient normaliser."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(16, 16)
        self.head = nn.Linear(16, 16)
        self.tail = nn.Linear(16, 16)

    def forward(self, x):
        with torch.no_grad():
            x = self.frozen(x)
        y = self.head(x)
        with torch.no_grad():
            s = y.norm()
        return self.tail(y / s)


class NestedModes(nn.Module):
    """inference_mode, and enable_grad inside no_grad."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        with torch.inference_mode():
            scale = x.abs().mean() + 1
        with torch.no_grad():
            h = self.a(x)
            with torch.enable_grad():
                h = self.b(h)
        return self.c(torch.tanh(h) * scale.clone())


class AutocastBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.a(x)
        return self.b(h.float().relu())


@pytest.mark.parametrize("cls", [FrozenFeatures, NestedModes, AutocastBlock])
def test_grad_mode_and_autocast_regions_survive(cls):
    x = torch.randn(8, 16)
    model = cls()
    gm = assert_same_step(model, lambda m: remat.checkpoint(m, (x,), solver="every-stage"), (x,))
    assert gm.remat_plan.info["frontend"] == "symbolic_trace"  # recorded, not dropped
    if cls is FrozenFeatures:
        _, grads, _ = train_step(gm, (x,))
        assert "frozen.weight" not in grads and "head.weight" in grads
        assert "with torch.no_grad():" in gm.code


def test_a_trace_that_drops_a_mode_fails_the_check_and_falls_back(monkeypatch):
    """The check is what catches a silently wrong trace: symbolic_trace without mode recording
    (remat before this check) loses the no_grad blocks, so the next frontend is used."""
    symbolic = importlib.import_module("remat.trace.symbolic")  # (remat.trace is the function)
    monkeypatch.setattr(symbolic, "recording_modes", contextlib.nullcontext)
    x = torch.randn(8, 16)
    gm = assert_same_step(FrozenFeatures(), lambda m: remat.trace(m, (x,)), (x,))
    assert gm.remat_frontend == "export"


class StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class Quantized(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.b(StraightThrough.apply(self.a(x)))


def test_no_frontend_that_agrees_is_a_trace_error_naming_the_difference():
    """Both frontends trace a custom autograd.Function's forward ops, not its backward: the
    gradients of everything before it differ, and remat says so instead of planning on it."""
    with pytest.raises(remat.TraceError, match=r"parameter 'a\.(weight|bias)'"):
        remat.checkpoint(Quantized(), (torch.randn(4, 8),), budget=0.5)


# --- the model's own checkpoint calls --------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.a, self.b = nn.Linear(w, 4 * w), nn.Linear(4 * w, w)

    def forward(self, x):
        return x + self.b(F.gelu(self.a(x)))


class SelfCheckpointed(nn.Module):
    """Checkpoints two pairs of its eight blocks itself."""

    def __init__(self, reentrant: bool, w: int = 64):
        super().__init__()
        self.inp = nn.Linear(w, w)
        self.blocks = nn.ModuleList(Block(w) for _ in range(8))
        self.reentrant = reentrant

    def forward(self, x):
        x = self.inp(x)
        x = cp.checkpoint(lambda t: self.blocks[1](self.blocks[0](t)), x, use_reentrant=self.reentrant)
        for b in self.blocks[2:5]:
            x = b(x)
        x = cp.checkpoint(lambda t: self.blocks[6](self.blocks[5](t)), x, use_reentrant=self.reentrant)
        return self.blocks[7](x)


@pytest.mark.parametrize("reentrant", [False, True])
def test_the_models_own_checkpoints_are_the_baseline(reentrant):
    model, x = SelfCheckpointed(reentrant), torch.randn(16, 64, 64)
    original_peak = remat.measure_peak(model, (x,))
    prof = remat.profile(model, (x,))
    assert prof.peak_bytes < prof.inlined_peak_bytes  # profiled with its checkpoints in place
    if not reentrant:  # the baseline is the model's own step
        assert abs(prof.peak_bytes - original_peak) <= 0.001 * original_peak
    gm = assert_same_step(model, lambda m: remat.checkpoint(m, (x,), budget=0.5), (x,))
    assert "replaced" in gm.remat_plan.describe()
    assert remat.measure_peak(gm, (x,)) <= min(gm.remat_plan.budget_bytes, original_peak)
    kept = assert_same_step(model, lambda m: remat.checkpoint(m, (x,), budget=1.0), (x,))
    assert "kept" in kept.remat_plan.describe() and kept.code.count("torch.utils.checkpoint.checkpoint(") == 2
    assert remat.measure_peak(kept, (x,)) <= kept.remat_plan.budget_bytes


def test_a_reentrant_checkpoint_whose_inputs_need_no_grad_is_warned_about():
    class Frozen(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            return self.b(cp.checkpoint(self.a, x, use_reentrant=True))

    with pytest.warns(remat.RematWarning, match="no input that requires grad"):
        remat.trace(Frozen(), (torch.randn(4, 8),))


# --- random ops ------------------------------------------------------------------------------------
class Attention(nn.Module):
    """Dropout inside scaled_dot_product_attention (a fused op torch tags as random), and
    alpha_dropout (missing from the name list remat had before)."""

    def __init__(self, w: int = 32):
        super().__init__()
        self.qkv, self.out, self.mlp = nn.Linear(w, 3 * w), nn.Linear(w, w), nn.Linear(w, w)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 4, -1)).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True)
        h = x + self.out(a.transpose(1, 2).flatten(2))
        return h + F.alpha_dropout(self.mlp(h), 0.3, training=self.training)


def test_dropout_inside_attention_inside_a_recomputed_region_replays_exactly():
    x = torch.randn(4, 16, 32)
    gm = assert_same_step(Attention(), lambda m: remat.checkpoint(m, (x,), solver="every-stage"), (x,))
    assert gm.remat_plan.regions
    calls = [line for line in gm.code.splitlines() if "torch.utils.checkpoint.checkpoint(" in line]
    assert calls and not any("preserve_rng_state=False" in c for c in calls)


def test_regions_without_random_ops_skip_the_rng_stash():
    x = torch.randn(4, 16, 32)
    model = Attention()
    model.eval()  # no dropout drawn: alpha_dropout is off and sdpa's dropout_p stays as written
    gm = remat.checkpoint(nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32)), (x,), solver="every-stage")
    assert "preserve_rng_state=False" in gm.code


# --- other input shapes ----------------------------------------------------------------------------
def _hf(name):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, use_cache=False,
                                         attn_implementation="sdpa")
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                                      intermediate_size=128, vocab_size=1000, use_cache=False,
                                      attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize("name", ["gpt2", pytest.param("llama", marks=pytest.mark.slow)])
def test_a_plan_for_4x128_runs_smaller_batches_and_sequences_exactly(name):
    model = _hf(name).train()
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (4, 128))
    gm = remat.checkpoint(model, (), {"input_ids": ids, "labels": ids}, budget=0.6)
    assert gm.remat_plan.info["inputs"]["input_ids"] == [4, 128]
    for shape in [(1, 128), (4, 64), (3, 97)]:
        small = torch.randint(0, vocab, shape)
        kwargs = {"input_ids": small, "labels": small}
        ref = train_step(model, (), kwargs=kwargs)
        got = train_step(gm, (), kwargs=kwargs)
        for a, b in zip(ref[0], got[0], strict=True):
            torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)
        assert ref[1].keys() == got[1].keys()
        for k in ref[1]:
            torch.testing.assert_close(got[1][k], ref[1][k], atol=1e-6, rtol=1e-5)
    out = gm(input_ids=ids, labels=ids)
    assert out.loss.dim() == 0 and torch.isfinite(out.loss)  # labels= gives the model's loss
    big = torch.randint(0, vocab, (8, 128))
    with pytest.warns(remat.RematWarning, match="larger than the planned"):
        gm(input_ids=big, labels=big)


def test_symbolic_traces_take_other_batches_and_warn_above_the_plan():
    torchvision = pytest.importorskip("torchvision")
    model = torchvision.models.resnet18()
    x = torch.randn(4, 3, 64, 64)
    plan = lambda m: remat.checkpoint(m, (x,), budget=0.9)  # noqa: E731  (its floor at this size is 0.82)
    gm = assert_same_step(model, plan, (torch.randn(2, 3, 64, 64),))  # planned at 4, run at 2
    assert gm.remat_plan.regions
    with pytest.warns(remat.RematWarning, match="budget no longer holds"):
        gm(torch.randn(8, 3, 64, 64))
    with pytest.raises(remat.ShapeError, match="planned for"):
        gm(torch.randn(3, 64, 64))


def test_apply_plan_refuses_a_plan_for_other_shapes():
    from remat.zoo import ResidualMLP

    model = ResidualMLP(width=64, depth=3)
    plan = remat.checkpoint(model, (torch.randn(4, 32, 64),), budget=0.6).remat_plan
    with pytest.raises(ValueError, match="made for inputs"):
        remat.apply_plan(model, (torch.randn(8, 32, 64),), plan)
    gm = remat.apply_plan(model, (torch.randn(8, 32, 64),), plan, allow_other_shapes=True)

    def count(regions) -> int:  # nested regions are checkpoint calls too
        return sum(1 + count(r.children) for r in regions)

    assert gm.code.count("checkpoint.checkpoint(") == count(plan.regions) > 0


def test_a_generated_module_pickles_with_its_checkpoints_and_modes():
    x = torch.randn(8, 16)
    gm = remat.checkpoint(FrozenFeatures(), (x,), solver="every-stage")
    back = pickle.loads(pickle.dumps(gm))
    assert back.code == gm.code and "torch.utils.checkpoint.checkpoint(" in back.code
    assert back.remat_plan == gm.remat_plan
    ref, got = train_step(gm, (x,)), train_step(back, (x,))
    for k in ref[1]:
        torch.testing.assert_close(got[1][k], ref[1][k])
    assert ref[1].keys() == got[1].keys()


class _ShapeBranchDropout(torch.nn.Module):
    """Branches on a shape (symbolic_trace cannot, torch.export can) and uses dropout and batch
    norm both as modules and as ``F.dropout(..., self.training)``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn, self.drop = torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.5)

    def forward(self, x):
        h = self.lin(x)
        if h.shape[0] > 1:
            h = h * 2
        return torch.nn.functional.dropout(self.drop(self.bn(h)), 0.3, self.training).relu()


def test_an_export_traced_module_follows_eval_like_the_model():
    model, x = _ShapeBranchDropout(), torch.randn(4, 8)
    gm = remat.checkpoint(model, (x,), solver="every-stage")
    assert gm.remat_frontend == "export"
    gm.eval(), model.eval()
    with torch.no_grad():
        assert torch.equal(gm(x), model(x))  # no dropout, running statistics: deterministic and equal
    gm.train(), model.train()
    torch.manual_seed(1)
    a = gm(x)
    torch.manual_seed(1)
    assert torch.allclose(a, model(x))  # and back in training the same masks and batch statistics


class _RacyGrad(torch.autograd.Function):
    """Identity whose backward adds a little noise from Python's RNG: a stand-in for a kernel whose
    reduction order depends on thread timing (bf16 depthwise convolution weight gradients)."""

    @staticmethod
    def forward(ctx, w):
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        import random

        return g * (1 + 0.5 * random.random())


class Racy(nn.Module):
    def __init__(self, outputs_too: bool = False):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.outputs_too = outputs_too

    def forward(self, x):
        import random

        y = torch.nn.functional.linear(x, _RacyGrad.apply(self.lin.weight), self.lin.bias)
        return y * (1 + random.random()) if self.outputs_too else y


def test_a_model_whose_own_gradients_do_not_reproduce_is_checked_by_shape_there():
    """A parameter gradient that differs between two steps of the model itself cannot be value-checked:
    compared by shape, with a warning; outputs that differ stay an error (a trace bakes in random
    numbers drawn outside torch)."""
    from remat.trace import trace

    x = torch.randn(4, 8)
    with pytest.warns(remat.RematWarning, match="different values for parameter 'lin.weight'"):
        trace(Racy(), (x,))
    with pytest.raises(remat.TraceError, match="output 0"):
        trace(Racy(outputs_too=True), (x,))


@pytest.mark.parametrize("layer", [lambda: nn.Embedding(50, 8, sparse=True),
                                   lambda: nn.EmbeddingBag(50, 8, mode="sum", sparse=True)])
def test_sparse_gradients_are_a_clear_error(layer):
    """Sparse gradients have no storage to follow: a RematError that names the parameter and the fix,
    not a NotImplementedError from deep inside the profiler."""
    model = nn.Sequential(layer(), nn.Linear(8, 2))
    x = torch.randint(0, 50, (4, 6))
    with pytest.raises(remat.RematError, match=r"'0.weight' gets a sparse gradient.*sparse=False"):
        remat.profile(model, (x,))


def test_a_trace_that_pins_the_batch_is_checked_at_the_planned_batch():
    """The check first runs a cut batch; a trace whose guards reject it is checked at the planned
    one instead of being reported as computing something else.  Its regions write the queue and
    read it back: recomputation sees the queue as the forward did."""
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    gm = assert_same_step(KeyQueue(), lambda m: remat.checkpoint(m, (x,), solver="every-stage"), (x,))
    assert gm.remat_frontend == "export"
    assert gm.remat_plan.regions and 'freeze="state"' in gm.code
    # the pinned batch is part of the shape contract: a smaller one is a ShapeError naming it, not
    # an AssertionError from export's guards
    with pytest.raises(remat.ShapeError, match="x"):
        gm(x[:4])


def test_a_torch_compile_wrapper_is_refused_with_the_way_round():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    with pytest.raises(remat.RematError, match=r"torch.compile\(remat.checkpoint\(model"):
        remat.checkpoint(torch.compile(model), (torch.randn(2, 4),), budget=0.5)


def test_hooks_on_submodules_run_at_every_step_of_the_checkpointed_module():
    """A hook that records features (a side effect) ran only while tracing when fx traced through
    its module; a full backward hook on a traced-through module made the trace fail.  Hooked
    modules are now calls: both hooks run when the checkpointed module trains."""
    torch.manual_seed(0)
    model, x = Hooked(), torch.randn(8, 16)
    seen = []
    model.blocks[1].register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    model.blocks[2].register_full_backward_hook(lambda mod, gin, gout: (gin[0] * 3,))
    with pytest.warns(remat.RematWarning, match="blocks.1, blocks.2 have hooks"):
        gm = assert_same_step(model, lambda m: remat.checkpoint(m, (x,), solver="every-stage"), (x,))
    assert gm.remat_frontend == "symbolic_trace"
    seen.clear()
    train_step(gm, (x,))
    assert len(seen) >= 1, "the forward hook ran in the checkpointed module's step"


def test_torch_nn_transformer_layers_are_traced_inside():
    """fx keeps torch.nn modules as single calls, nn.TransformerEncoder included: a model built from
    one had nothing to checkpoint apart (InfeasibleBudget at any budget below its peak).  Such calls
    send the trace to torch.export, which goes inside them."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
    model, x = nn.TransformerEncoder(layer, 3), torch.randn(4, 64, 32)
    gm = assert_same_step(model, lambda m: remat.checkpoint(m, (x,), budget=0.5), (x,))
    assert gm.remat_frontend == "export" and gm.remat_plan.regions
    assert remat.measure_peak(gm, (x,)) <= gm.remat_plan.budget_bytes


class _PlainTensorAttribute(nn.Module):
    """A tensor kept as a plain attribute (neither parameter nor buffer), as T5 and DeBERTa's
    attention code end up with under torch.export."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = torch.linspace(0.5, 1.5, 8)

    def forward(self, x):
        return self.lin(x) * self.scale


def test_tensors_the_trace_lifts_stay_out_of_the_state_dict():
    """They are registered as buffers so the profile counts them, but not persistent: the
    checkpointed module's state_dict keeps exactly the model's keys (loadable both ways)."""
    model, x = _PlainTensorAttribute(), torch.randn(4, 8)
    gm = remat.checkpoint(model, (x,), solver="none")
    assert list(gm.state_dict()) == list(model.state_dict())
    model.load_state_dict(gm.state_dict())

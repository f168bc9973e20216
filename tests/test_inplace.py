"""remat.checkpoint_: the user's module object stays theirs; --code files run on their own; a
generated module's train/eval flags."""
import copy
import subprocess
import sys
import warnings

import pytest
import torch

import remat
from conftest import remat_env
from remat.testing import assert_same_step, train_step
from remat.zoo import ResidualMLP


def _gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, use_cache=False,
                                     attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


@pytest.fixture(scope="module")
def gpt2():
    """A random-weight GPT-2 planned in place with labels (the same tensor as the ids, as a training
    loop passes them), and an untouched copy."""
    model = _gpt2()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert remat.checkpoint_(model, (ids,), {"labels": ids}, budget=0.9) is model
    return model, reference, ids


def _grads(model):
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.slow
def test_the_model_object_stays_and_its_forward_runs_the_plan(gpt2):
    model, reference, ids = gpt2
    plan = model.remat_plan
    assert plan.regions and plan.predicted_peak_bytes <= plan.budget_bytes
    assert list(model.state_dict()) == list(reference.state_dict())  # nothing registered on the model
    assert model.config is not None and hasattr(model, "generate") and hasattr(model, "save_pretrained")
    ran = []
    inner = model.__dict__["_remat_inplace"].module
    handle = inner.register_forward_pre_hook(lambda *a: ran.append(1))
    try:
        for m in (model, reference):
            m.zero_grad(set_to_none=True)
            torch.manual_seed(3)
            m(ids, labels=ids).loss.backward()
    finally:
        handle.remove()
    assert ran == [1], "the planned module did not run"
    ref = _grads(reference)
    got = _grads(model)
    assert got.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_other_labels_than_the_planned_tensor_give_the_originals_loss(gpt2):
    """Planned with labels=ids (one tensor passed twice), called with other labels: the plan must
    not read one input for the other."""
    model, reference, ids = gpt2
    other = torch.randint(0, 1000, ids.shape, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(7)
    got = model.__dict__["_remat_inplace"].module(ids, labels=other).loss
    torch.manual_seed(7)
    torch.testing.assert_close(got, reference(ids, labels=other).loss)


@pytest.mark.slow
def test_generate_works_after_planning(gpt2):
    model, reference, ids = gpt2
    model.eval(), reference.eval()
    try:
        got = model.generate(ids[:, :5], max_new_tokens=6, do_sample=False, pad_token_id=0)
        want = reference.generate(ids[:, :5], max_new_tokens=6, do_sample=False, pad_token_id=0)
    finally:
        model.train(), reference.train()
    assert got.shape == (2, 11) and torch.equal(got, want)
    torch.manual_seed(4)  # in training mode too (dropout on: same seed, same draws)
    got = model.generate(ids[:, :5], max_new_tokens=3, do_sample=True, pad_token_id=0)
    torch.manual_seed(4)
    assert torch.equal(got, reference.generate(ids[:, :5], max_new_tokens=3, do_sample=True, pad_token_id=0))


@pytest.mark.slow
def test_calls_the_plan_does_not_cover_run_the_original_forward(gpt2):
    model, reference, ids = gpt2
    mask = torch.ones_like(ids)
    with pytest.warns(remat.RematWarning, match="original forward.*attention_mask"):
        torch.manual_seed(5)
        got = model(ids, labels=ids, attention_mask=mask).loss
    torch.manual_seed(5)
    torch.testing.assert_close(got, reference(ids, labels=ids, attention_mask=mask).loss)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # no_grad is an expected call: no warning
        torch.manual_seed(6)
        got = model(ids).logits
    torch.manual_seed(6)
    with torch.no_grad():
        torch.testing.assert_close(got, reference(ids).logits)


@pytest.mark.slow
def test_a_training_loop_with_adamw_ends_with_the_same_parameters(gpt2, tmp_path):
    model, reference, ids = gpt2
    model, reference = copy.deepcopy(model), copy.deepcopy(reference)  # the copy keeps its plan
    assert model.__dict__["_remat_inplace"].module is not gpt2[0].__dict__["_remat_inplace"].module
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, reference)]
    for step in range(3):
        batch = {"input_ids": ids, "labels": ids}  # as a Trainer passes it: by keyword
        for m, opt in zip((model, reference), optimizers):
            torch.manual_seed(step)
            m(**batch).loss.backward()
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    assert not torch.equal(next(model.parameters()), next(gpt2[1].parameters()))  # it did train
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path)
    for (name, p), q in zip(loaded.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, msg=lambda m: f"{name}: {m}")
    remat.restore_(model)
    assert "forward" not in model.__dict__ and not hasattr(model, "remat_plan")
    with pytest.raises(ValueError, match="no plan attached"):
        remat.restore_(model)


def test_the_in_place_rule_on_a_small_model():
    torch.manual_seed(0)
    model = ResidualMLP(width=32, depth=4)
    reference = copy.deepcopy(model)
    x = torch.randn(4, 64, 32)
    remat.checkpoint_(model, (x,), budget=0.7)
    inner = model.__dict__["_remat_inplace"].module
    ran = []
    inner.register_forward_pre_hook(lambda *a: ran.append(1))
    ref = train_step(reference, (x,))
    got = train_step(model, (x,))
    assert ran == [1]
    for k in ref[1]:
        torch.testing.assert_close(got[1][k], ref[1][k], atol=1e-6, rtol=1e-5)
    model.eval()
    model(x).sum().backward()  # eval: the original forward
    assert ran == [1]
    model.train()
    with torch.no_grad():
        model(x)
    assert ran == [1]
    model(x=x).sum().backward()  # by keyword: still the planned call
    assert ran == [1, 1]
    model(x[:2]).sum().backward()  # a smaller batch: within the contract
    assert ran == [1, 1, 1]
    remat.restore_(model)
    model(x)
    assert ran == [1, 1, 1]


@pytest.mark.slow
def test_generated_modules_keep_train_and_eval_consistent(gpt2):
    torch.manual_seed(0)
    mlp = ResidualMLP(width=32, depth=4)
    x = torch.randn(4, 64, 32)
    for gm in (remat.checkpoint(mlp, (x,), budget=0.7), gpt2[0].__dict__["_remat_inplace"].module):
        for mode in (False, True, False, True):
            gm.train(mode)
            assert gm.training is mode and all(m.training is mode for m in gm.modules())


@pytest.mark.slow
def test_an_export_traced_module_in_eval_mode_is_deterministic(gpt2):
    gm = gpt2[0].__dict__["_remat_inplace"].module
    assert gm.remat_frontend == "export"
    gm.eval()
    try:
        with torch.no_grad():
            ids = gpt2[2]  # the module was planned with labels: it takes them (and returns the loss)
            first, second = gm(ids, labels=ids), gm(ids, labels=ids)
            assert torch.equal(first.logits, second.logits) and torch.equal(first.loss, second.loss)
    finally:
        gm.train()


FACTORY = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.blocks = nn.ModuleList(nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
                                    for _ in range(4))
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x.mean((2, 3)))


def make(batch):
    torch.manual_seed(0)
    return Net(), (torch.randn(batch, 3, 32, 32),)
'''

CHECK = '''
import torch
import planned, nets
from remat.testing import assert_same_step

model, inputs = nets.make(batch=2)
new = assert_same_step(model, planned.load, inputs)
assert type(new).__name__ == "RematNet" and "torch.utils.checkpoint.checkpoint(" in open(planned.__file__).read()
assert [n for n, _ in new.named_parameters()] == [n for n, _ in model.named_parameters()]
print("same step")
'''


@pytest.mark.slow
def test_a_code_file_runs_on_its_own(run_remat, tmp_path):
    (tmp_path / "nets.py").write_text(FACTORY)
    done = run_remat("plan", "nets:make", "--batch", "2", "--budget", "0.6", "--code", "planned.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "wrote a runnable module to planned.py" in done.stdout
    (tmp_path / "check.py").write_text(CHECK)
    ran = subprocess.run([sys.executable, "check.py"], cwd=tmp_path, env=remat_env(), capture_output=True,
                         text=True, timeout=300)
    assert ran.returncode == 0 and ran.stdout.strip() == "same step", ran.stderr


def test_a_code_file_for_an_export_trace_runs_on_its_own(tmp_path):
    """torch.export traces read pytree specs and a guard module the model lacks: the file rebuilds them."""
    from remat.cli.standalone import write_module

    class Pair(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x, scale=None):
            if x.shape[-1] == 8:  # Python on a size: symbolic_trace cannot, torch.export can
                x = x * 2
            h = torch.relu(self.a(x))
            return {"out": self.b(h) * scale, "h": h}

    torch.manual_seed(0)
    model = Pair()
    x, scale = torch.randn(4, 8), torch.full((1,), 0.5)
    gm = remat.checkpoint(model, (x,), {"scale": scale}, solver="every-stage")
    assert gm.remat_frontend == "export"
    path = tmp_path / "pair_planned.py"
    write_module(gm, path, model)
    sys.path.insert(0, str(tmp_path))
    try:
        import pair_planned
    finally:
        sys.path.remove(str(tmp_path))
    new = assert_same_step(model, pair_planned.load, (x,), kwargs={"scale": scale})
    assert "_in_spec" in path.read_text() and set(new(x, scale=scale)) == {"out", "h"}


def test_a_copy_of_a_model_waiting_for_its_first_call_plans_itself():
    """checkpoint_ without example inputs plans at the first training call; a deep copy made before
    it (a Trainer's model_init, an EMA copy) plans itself and leaves the original waiting."""
    import copy

    from remat.zoo import ResidualMLP

    torch.manual_seed(0)
    model = ResidualMLP(width=64, depth=4, p=0.0)
    reference = copy.deepcopy(model)
    remat.checkpoint_(model, budget=0.5)
    twin = copy.deepcopy(model)
    x = torch.randn(4, 64, 64)
    twin(x).sum().backward()
    reference(x).sum().backward()
    assert twin.remat_plan.regions and model.__dict__.get("remat_plan") is None
    assert all(p.grad is None for p in model.parameters())
    for p, q in zip(twin.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5)
    with torch.no_grad():
        assert model(x).shape == (4, 64, 10)  # still waiting: runs its own forward

"""remat meets the objects LLM trainers use as they are: PEFT models, the real Hugging Face
Trainer, accelerate, models built on the meta device (the real packages, nothing mocked)."""
import copy
import inspect
import tempfile
import warnings

import pytest
import torch

import remat
import remat.inplace as inplace
from remat.testing import assert_predicted, assert_same_step

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
accelerate = pytest.importorskip("accelerate")


def _llama(layers: int = 2, dtype: torch.dtype = torch.float32):
    config = transformers.LlamaConfig(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(dtype)


def _gpt2():
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=64, use_cache=False)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


LORA = {
    "q,v": dict(r=8, target_modules=["q_proj", "v_proj"]),
    "all linear, dropout": dict(r=4, lora_dropout=0.1, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                      "gate_proj", "up_proj", "down_proj"]),
}


@pytest.mark.parametrize("base_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16 base"])
@pytest.mark.parametrize("lora", list(LORA), ids=list(LORA))
def test_peft_lora_models_plan_directly(lora, base_dtype):
    """A PeftModel's forward takes (*args, **kwargs): torch.export's dynamic-shape guards for it
    named an undefined ``L`` (NameError at the first call), so remat could not trace it.  Now it
    plans, trains like the model (LoRA gradients too, fp32 adapters on a bf16 base) and runs
    smaller batches (the dimensions stay dynamic)."""
    model = peft.get_peft_model(_llama(dtype=base_dtype), peft.LoraConfig(**LORA[lora])).train()
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()
    ids = torch.randint(0, 500, (4, 48))
    scale = 1e-5 if base_dtype == torch.float32 else 2e-2
    gm = assert_same_step(model, lambda m: remat.checkpoint(m, (ids,), {"labels": ids}, budget="min"), (ids,),
                          kwargs={"labels": ids}, scale=scale)
    assert gm.remat_plan.regions and gm.remat_frontend == "export"
    assert any("lora_B" in n for n, p in gm.named_parameters() if p.requires_grad)
    assert remat.measure_peak(gm, (ids,), {"labels": ids}) <= gm.remat_plan.budget_bytes
    small = ids[:2, :24]
    assert_same_step(model, lambda m: gm, (small,), kwargs={"labels": small}, scale=scale)


def test_checkpoint_in_place_keeps_the_forward_signature():
    model = _gpt2()
    before = inspect.signature(model.forward)
    ids = torch.randint(0, 500, (4, 32))
    remat.checkpoint_(model, (), {"input_ids": ids, "labels": ids}, budget=0.5)
    assert inspect.signature(model.forward) == before
    assert "input_ids" in inspect.signature(model.forward).parameters
    remat.restore_(model)
    assert inspect.signature(model.forward) == before


class _Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.x = torch.randint(0, 500, (40, 32), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def _covered_calls(monkeypatch) -> dict:
    """Counts the model calls the plan covers (InPlace.run with nothing to refuse)."""
    calls = {"planned": 0}
    run = inplace.InPlace.run

    def counting(self, model, args, kwargs):
        calls["planned"] += self.covers(model, inplace._Call.bind(self.signature, args, kwargs)) is None
        return run(self, model, args, kwargs)

    monkeypatch.setattr(inplace.InPlace, "run", counting)
    return calls


def _train_with_trainer(model) -> list[float]:
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = transformers.TrainingArguments(output_dir=out, per_device_train_batch_size=8, max_steps=4,
                                              report_to=[], use_cpu=True, logging_steps=1, seed=0, data_seed=0,
                                              disable_tqdm=True)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens())
        trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("how", ["planned for the Trainer's call", "planned at the first call"])
def test_the_real_trainer_with_default_arguments_runs_the_plan(monkeypatch, how):
    """transformers.Trainer keeps only the batch keys inspect.signature(model.forward) names; with
    checkpoint_'s old (*args, **kwargs) forward it dropped input_ids and failed at the first step.
    Four AdamW steps now give the losses and parameters of an un-checkpointed run, every call planned."""
    model, reference = _gpt2(), _gpt2()
    if how == "planned at the first call":
        remat.checkpoint_(model, budget=0.5)
    else:  # the Trainer passes num_items_in_batch, a float32 count of the labels it averages over
        ids = torch.randint(0, 500, (8, 32))
        remat.checkpoint_(model, (), {"input_ids": ids, "labels": ids, "num_items_in_batch": torch.tensor(248.0)},
                          budget=0.5)
    calls = _covered_calls(monkeypatch)
    losses = _train_with_trainer(model)
    assert model.remat_plan.regions and calls["planned"] == 4
    assert losses == _train_with_trainer(reference)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("lora", list(LORA), ids=list(LORA))
def test_peft_lora_models_plan_under_a_bf16_autocast(lora):
    """The Trainer's ``bf16=True`` plans a PEFT model under autocast: float32 tensors computing in
    bf16.  The trace check compared the trace's adapter gradients with the model's at float32's
    tolerance, and the two round bf16 sums differently (LoRA B: by 0.05-0.5, with eager bf16 itself
    1-1.5 % off float32), so no PeftModel could be planned for bf16 training."""
    model = peft.get_peft_model(_llama(), peft.LoraConfig(**LORA[lora])).train()
    for name, p in model.named_parameters():
        if "lora_B" in name:  # zero at init: their input gradients would be zero too
            torch.nn.init.normal_(p, std=0.02)
    ids = torch.randint(0, 500, (4, 48))
    with torch.autocast("cpu", torch.bfloat16):
        gm = assert_same_step(model, lambda m: remat.checkpoint(m, (ids,), {"labels": ids}, budget=0.8), (ids,),
                              kwargs={"labels": ids}, scale=2e-2)
    assert gm.remat_plan.regions and any("lora_B" in n for n, p in gm.named_parameters() if p.requires_grad)


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_accelerate_prepare_runs_the_plan(monkeypatch, precision):
    """``mixed_precision="bf16"`` (the Trainer's ``bf16=True``) plans at the first call, under
    accelerate's autocast: regions keeping matmul outputs failed in the backward when the plan had
    them (test_selective.py has the deterministic case), and planning at the first call put its own
    forward over accelerate's autocast wrapper: the next calls ran without autocast."""
    def run(model, plan: bool) -> tuple[list[float], torch.nn.Module]:
        torch.manual_seed(0)
        accelerate.state.AcceleratorState._reset_state(True)
        acc = accelerate.Accelerator(cpu=True, mixed_precision=precision)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        rows = torch.randint(0, 500, (24, 32), generator=torch.Generator().manual_seed(1))
        data = torch.utils.data.DataLoader([{"input_ids": x, "labels": x} for x in rows], batch_size=8)
        if plan:
            remat.checkpoint_(model, budget=0.5)
        model, opt, data = acc.prepare(model, opt, data)
        losses = []
        with warnings.catch_warnings():  # every call runs the plan, under accelerate's autocast
            warnings.filterwarnings("error", message=".*original forward", category=remat.RematWarning)
            for batch in data:
                out = model(**batch)
                acc.backward(out.loss)
                opt.step()
                opt.zero_grad()
                losses.append(out.loss.item())
        return losses, model

    calls = _covered_calls(monkeypatch)
    planned, model = run(_gpt2(), True)
    plain, reference = run(_gpt2(), False)
    assert model.remat_plan.regions and calls["planned"] == 3
    # bf16: the export graph rounds some sums differently; AdamW turns a near-zero gradient's sign
    # into a step of about lr (1e-3), so after 3 steps parameters agree to a few lr
    exact = precision == "no"
    torch.testing.assert_close(planned, plain, atol=0 if exact else 1e-3, rtol=0 if exact else 1e-2)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=0 if exact else 3e-3 + 1e-6, rtol=0 if exact else 1e-2)


def test_a_call_with_another_dtype_runs_the_original_with_a_warning():
    """An export graph asserts its inputs' dtypes: a Trainer's float32 num_items_in_batch against
    a plan made with an int64 one failed inside the graph ("Tensor dtype mismatch"); now the
    contract refuses it first and checkpoint_ runs the original forward, saying why."""
    model = _gpt2()
    ids = torch.randint(0, 500, (4, 32))
    remat.checkpoint_(model, (), {"input_ids": ids, "labels": ids, "num_items_in_batch": torch.tensor(124)},
                      budget=0.5)
    with pytest.warns(remat.RematWarning, match="dtype torch.float32; this module was planned for torch.int64"):
        out = model(input_ids=ids, labels=ids, num_items_in_batch=torch.tensor(124.0))
    out.loss.backward()


def test_a_default_config_with_the_kv_cache_on_plans_and_keeps_its_cache_for_generate():
    """Most configs default to use_cache=True: the trace met a DynamicCache in the output and
    failed ("Found DynamicCache in output"). Training keeps no cache: remat traces with it off and
    puts the config back, so generate() still uses it."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500))
    assert model.config.use_cache
    ids = torch.randint(0, 500, (4, 64))
    reference = copy.deepcopy(model)
    remat.checkpoint_(model, (ids,), {"labels": ids}, budget=0.7)
    assert model.config.use_cache and model.remat_plan.regions
    torch.manual_seed(1)  # the default config has dropout: the same draws in both
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    torch.manual_seed(1)
    ref = reference(input_ids=ids, labels=ids)
    ref.loss.backward()
    torch.testing.assert_close(out.loss, ref.loss)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5)
    with torch.no_grad():
        generated = model.generate(ids[:1, :8], max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, 12)


@pytest.mark.parametrize("how", ["torch.device('meta')", "accelerate.init_empty_weights"])
def test_a_model_built_on_meta_plans_and_its_plan_applies_to_the_materialized_model(how, tmp_path):
    """How anyone plans a model bigger than the planning machine: built without memory, planned
    for the CPU and for a GPU, the plan saved, then applied to the real model without solving.
    The export trace of a meta model made its tensors on meta (``device=self.weight.device``) and
    failed its check ("Tensor device mismatch! Expected: meta, Got: cpu")."""
    config = transformers.LlamaConfig(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    if how.startswith("torch"):
        with torch.device("meta"):
            empty = transformers.LlamaForCausalLM(config).train()
    else:
        with accelerate.init_empty_weights():
            empty = transformers.LlamaForCausalLM(config).train()
    meta_ids = torch.empty(4, 64, dtype=torch.long, device="meta")
    prof = remat.profile(empty, (meta_ids,), {"labels": meta_ids})
    assert prof.peak_bytes > prof.param_bytes > 0
    assert all(p.device.type == "meta" for p in empty.parameters())  # nothing allocated
    gpu = remat.checkpoint(empty, (meta_ids,), {"labels": meta_ids}, budget=0.6, device="cuda").remat_plan
    assert gpu.regions and gpu.info["device"] == "cuda"
    remat.checkpoint(empty, (meta_ids,), {"labels": meta_ids}, budget=0.6).remat_plan.to_json(tmp_path / "plan.json")
    plan = remat.load_plan(tmp_path / "plan.json")
    assert plan.regions

    torch.manual_seed(0)
    real = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 500, (4, 64))
    gm = assert_same_step(real, lambda m: remat.apply_plan(m, (ids,), plan, {"labels": ids}), (ids,),
                          kwargs={"labels": ids}, scale=1e-5)
    assert gm.remat_plan.regions == plan.regions
    measured = remat.measure_peak(gm, (ids,), {"labels": ids})
    assert measured <= plan.budget_bytes
    assert_predicted(plan.predicted_peak_bytes, measured, what="a plan made on meta, on the real model")
    in_place = copy.deepcopy(real)
    remat.checkpoint_(in_place, (ids,), {"labels": ids}, plan=plan)
    assert in_place.remat_plan.regions == plan.regions
    in_place(ids, labels=ids).loss.backward()


@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_transformers_gradient_checkpointing_is_seen_as_the_models_own_regions(build):
    """With ``gradient_checkpointing_enable()`` each decoder layer runs under torch's checkpoint; the
    export trace marks every layer's nodes but one (``training * p``, the attention dropout
    probability, a symbolic scalar), so each call looked non-contiguous: remat warned once per layer
    and predicted the step without them.  Now the step's peak is the model's, with its checkpoints,
    and the plan trains exactly within budget."""
    model = build().train()
    model.gradient_checkpointing_enable()
    ids = torch.randint(0, 500, (4, 48))
    plain = build().train()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*checkpoint call .* does not cover")
        profile = remat.profile(model, (ids,), {"labels": ids})
        gm = assert_same_step(model, lambda m: remat.checkpoint(m, (ids,), {"labels": ids}, budget="min"), (ids,),
                              kwargs={"labels": ids}, scale=1e-5)  # export's float sums: Llama's embedding
    assert profile.peak_bytes < remat.profile(plain, (ids,), {"labels": ids}).peak_bytes
    assert remat.measure_peak(gm, (ids,), {"labels": ids}) <= gm.remat_plan.budget_bytes

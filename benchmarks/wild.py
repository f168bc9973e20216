"""Models nobody here wrote: transformers architectures beyond the zoo's four, torch.nn's own
transformer, recurrent nets, and the patterns that broke remat outside its benchmarks (state written
in forward, hooks, random draws of every kind, a torch.nn module made of layers, a batch-pinning
trace).  Each is planned at a budget, trained one step next to the original (gradients and buffers
compared at fp32 reordering tolerance) and measured against the budget.  A row per model; a failure
is a row.  Writes benchmarks/results/wild.md.

    python benchmarks/wild.py [--models t5,lstm] [--budget 0.6]
"""
from __future__ import annotations

import argparse
import copy
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.testing import train_step
from remat.testing.patterns import Hooked, KeyQueue, RandomDraws, Recurrent, SpectralNet

from common import md_table, write_result

Case = Callable[[], tuple[nn.Module, tuple, dict]]


def _ids(n: int = 4, s: int = 128) -> torch.Tensor:
    return torch.randint(0, 1000, (n, s), generator=torch.Generator().manual_seed(0))


def _hf(name: str) -> tuple[nn.Module, tuple, dict]:
    import transformers as T

    ids, c = _ids(), dict(vocab_size=1000, use_cache=False)
    small = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4)
    makers: dict[str, Callable[[], tuple[nn.Module, dict]]] = {
        "t5": lambda: (T.T5ForConditionalGeneration(T.T5Config(d_model=128, d_kv=32, d_ff=256, num_layers=2, num_heads=4,
                                                               decoder_start_token_id=0, pad_token_id=0, **c)),
                       {"labels": ids.clone()}),
        "bart": lambda: (T.BartForConditionalGeneration(T.BartConfig(
            d_model=128, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=256, decoder_ffn_dim=256, **c)), {"labels": ids.clone()}),
        "mistral": lambda: (T.MistralForCausalLM(T.MistralConfig(num_key_value_heads=2, **small, **c)), {}),
        "qwen2": lambda: (T.Qwen2ForCausalLM(T.Qwen2Config(num_key_value_heads=2, **small, **c)), {}),
        "gemma": lambda: (T.GemmaForCausalLM(T.GemmaConfig(num_key_value_heads=1, head_dim=32, **small, **c)), {}),
        "phi": lambda: (T.PhiForCausalLM(T.PhiConfig(**small, **c)), {}),
        "mixtral": lambda: (T.MixtralForCausalLM(T.MixtralConfig(
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, **small, **c)), {}),
        "falcon": lambda: (T.FalconForCausalLM(T.FalconConfig(hidden_size=128, num_hidden_layers=3,
                                                              num_attention_heads=4, **c)), {}),
        "gptj": lambda: (T.GPTJForCausalLM(T.GPTJConfig(n_embd=128, n_layer=3, n_head=4, rotary_dim=16,
                                                        bos_token_id=0, eos_token_id=0, **c)), {}),
        "opt": lambda: (T.OPTForCausalLM(T.OPTConfig(hidden_size=128, ffn_dim=256, num_hidden_layers=3,
                                                     num_attention_heads=4, word_embed_proj_dim=128, **c)), {}),
        "deberta": lambda: (T.DebertaV2ForMaskedLM(T.DebertaV2Config(vocab_size=1000, **small)), {}),
        "electra": lambda: (T.ElectraForPreTraining(T.ElectraConfig(vocab_size=1000, embedding_size=128, **small)), {}),
        "distilbert": lambda: (T.DistilBertForMaskedLM(T.DistilBertConfig(vocab_size=1000, dim=128, n_layers=3,
                                                                          n_heads=4, hidden_dim=256)), {}),
    }
    model, kwargs = makers[name]()
    return model, (ids,), kwargs


class _UNet(nn.Module):
    def __init__(self, c: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.down, self.up, ch = nn.ModuleList(), nn.ModuleList(), 3
        for i in range(depth):
            self.down.append(nn.Sequential(nn.Conv2d(ch, c << i, 3, padding=1), nn.GroupNorm(4, c << i), nn.SiLU()))
            ch = c << i
        for i in reversed(range(depth - 1)):
            self.up.append(nn.Sequential(nn.Conv2d(ch + (c << i), c << i, 3, padding=1), nn.GroupNorm(4, c << i),
                                         nn.SiLU()))
            ch = c << i
        self.out = nn.Conv2d(ch, 2, 1)

    def forward(self, x):
        skips = []
        for i, d in enumerate(self.down):
            x = d(x)
            if i < len(self.down) - 1:
                skips.append(x)
                x = F.max_pool2d(x, 2)
        for u in self.up:
            x = u(torch.cat([F.interpolate(x, scale_factor=2.0), skips.pop()], 1))
        return self.out(x)


def _encoder() -> nn.Module:
    return nn.TransformerEncoder(nn.TransformerEncoderLayer(128, 4, 256, dropout=0.1, batch_first=True), 4)


def _hooked() -> nn.Module:
    """A feature-recording forward hook and a gradient-scaling full backward hook."""
    model = Hooked(256, 6)
    features: list[torch.Size] = []
    model.blocks[2].register_forward_hook(lambda m, a, out: features.append(out.shape))
    model.blocks[4].register_full_backward_hook(lambda m, gin, gout: (gin[0] * 0.5,))
    return model


CUSTOM: dict[str, Case] = {
    "nn.TransformerEncoder": lambda: (_encoder(), (torch.randn(8, 128, 128),), {}),
    "spectral_norm": lambda: (SpectralNet(256), (torch.randn(64, 128, 256),), {}),
    "key_queue": lambda: (KeyQueue(256, 512, 6), (torch.randn(512, 256),), {}),
    "hooks": lambda: (_hooked(), (torch.randn(32, 128, 256),), {}),
    "random_draws": lambda: (RandomDraws(256), (torch.randn(2048, 256),), {}),
    "unet": lambda: (_UNet(), (torch.randn(4, 3, 128, 128),), {}),
    "lstm": lambda: (Recurrent(1000, 64, 128), (_ids(32, 100),), {}),
}
HF = ["t5", "bart", "mistral", "qwen2", "gemma", "phi", "mixtral", "falcon", "gptj", "opt", "deberta", "electra",
      "distilbert"]


def _close(a: dict, b: dict) -> str | None:
    """The first name whose values differ beyond fp32 reordering (the trace check's tolerance)."""
    if a.keys() != b.keys():
        return f"names differ: {sorted(set(a) ^ set(b))[:3]}"
    for k in a:
        x, y = a[k].double(), b[k].double()
        if not torch.allclose(y, x, rtol=1e-4, atol=1e-6 * max(1.0, x.abs().max().item())):
            return k
    return None


def run(name: str, budget: float) -> list[object]:
    torch.manual_seed(0)
    model, args, kwargs = CUSTOM[name]() if name in CUSTOM else _hf(name)
    model.train()
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gm = remat.checkpoint(copy.deepcopy(model), args, kwargs, budget=budget)
    except remat.InfeasibleBudget as e:
        return [name, "-", "-", "-", "-", "-", "-", f"{time.perf_counter() - start:.1f}",
                f"InfeasibleBudget: floor {e.min_fraction:.3f}, bound {(e.bound_bytes or 0) / 2**20:.2f} MiB"]
    except Exception as e:  # noqa: BLE001 - a failure is a row
        return [name, "-", "-", "-", "-", "-", "-", f"{time.perf_counter() - start:.1f}",
                f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"]
    seconds = time.perf_counter() - start
    ref, got = train_step(model, args, 3, kwargs), train_step(gm, args, 3, kwargs)
    # the model's buffers (the trace adds non-persistent ones: constants torch.export lifted)
    wrong = _close(ref[1], got[1]) or _close(ref[2], {k: v for k, v in got[2].items() if k in ref[2]})
    if wrong is None and not all(torch.allclose(b, a, rtol=1e-4, atol=1e-5) for a, b in zip(ref[0], got[0])):
        wrong = "outputs"
    plan = gm.remat_plan
    peak = remat.measure_peak(gm, args, kwargs)
    fits = peak <= plan.budget_bytes
    return [name, gm.remat_frontend, len(plan.regions), f"{plan.budget_bytes / 2**20:.2f}",
            f"{plan.predicted_peak_bytes / 2**20:.2f}", f"{peak / 2**20:.2f}", f"{plan.recompute_ratio:.1%}",
            f"{seconds:.1f}", "pass" if wrong is None and fits else f"FAIL: {wrong or 'over budget'}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="", help="comma-separated names (default: all)")
    ap.add_argument("--budget", type=float, default=0.6)
    a = ap.parse_args()
    names = a.models.split(",") if a.models else [*CUSTOM, *HF]
    rows = []
    for name in names:
        rows.append(run(name, a.budget))
        print(" | ".join(str(c) for c in rows[-1]), flush=True)
    passed = sum(1 for r in rows if r[-1] == "pass")
    header = ["model", "frontend", "regions", "budget MiB", "predicted MiB", "measured MiB", "recompute", "plan s",
              "result"]
    write_result("wild.md", "Models nobody here wrote", [
        f"Rotor at budget {a.budget} (docs/design.md fraction), CPU, one training step against the original "
        f"model (outputs, gradients and buffers within fp32 reordering), measured peak against the budget. "
        f"{passed}/{len(rows)} pass; an InfeasibleBudget row gives remat's floor (a fraction) and the bound no "
        "checkpointing goes below.",
        md_table(header, rows)])


if __name__ == "__main__":
    main()

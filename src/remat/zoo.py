"""Model specs for the CLI and benchmarks: build a model and example inputs from one string.

``torchvision:resnet50``                 a torchvision model, random weights, 3x224x224 images
``transformers:gpt2``                    GPT-2/BERT/Llama/ViT from a config, random weights, nothing downloaded
``transformers:gpt2:layers=6,width=512,seq=256``   options after a second colon
``transformers:gpt2-medium``             24 layers, width 1024, 16 heads, seq 1024
``transformers:llama:layers=32,width=4096,heads=32,ffn=11008,seq=4096``   a Llama-7B shape (also kv_heads=, vocab=)
``package.module:factory``               ``factory(batch=N)`` returning ``(model, example_inputs)``
``mlp``                                  the built-in default: a residual MLP with dropout on 256 tokens

Weights are always freshly initialized: remat never downloads or copies a user's weights.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .specs import DEFAULT_SPEC, FACTORY_CONTRACT, did_you_mean, parse_spec

__all__ = ["Workload", "build", "DEFAULT_SPEC", "ResidualMLP"]


@dataclass
class Workload:
    """A model with example inputs; ``shared_inputs`` names inputs that may cross any stage cut."""

    name: str
    model: nn.Module
    inputs: tuple[Any, ...]
    shared_inputs: tuple[str, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    about: str = ""  # what the spec built, for people ("GPT-2, 4 layers x 256 wide, ...")

    @property
    def title(self) -> str:
        return f"{self.name} ({self.about})" if self.about else self.name


class ResidualMLP(nn.Module):
    """The built-in default model: residual MLP blocks with LayerNorm and Dropout(0.2)."""

    def __init__(self, width: int = 512, depth: int = 8, classes: int = 10, p: float = 0.2) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(depth)
        )
        self.drop = nn.Dropout(p)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = self.drop(x + block(x))
        return self.head(x)


def _input_device(meta: bool) -> str:
    return "meta" if meta else "cpu"


def _torchvision(name: str, batch: int, meta_inputs: bool) -> Workload:
    try:
        import torchvision
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("torchvision specs need torchvision: pip install 'remat[vision]'") from e
    names = torchvision.models.list_models()
    if name not in names:
        raise ValueError(f"torchvision has no model {name!r}{did_you_mean(name, names)}; "
                         "torchvision.models.list_models() lists them")
    kwargs: dict[str, Any] = {"weights": None}
    if name in ("inception_v3", "googlenet"):
        kwargs["init_weights"] = False  # the scipy-based init is slow and irrelevant to memory
        kwargs["aux_logits"] = False
    model = torchvision.models.get_model(name, **kwargs)
    size = 299 if name == "inception_v3" else 224
    gen = torch.Generator().manual_seed(0)
    if meta_inputs:
        x = torch.empty(batch, 3, size, size, device="meta")
    else:
        x = torch.rand(batch, 3, size, size, generator=gen)
    return Workload(f"torchvision:{name}", model, (x,))


_HF_PRESETS = {
    "gpt2": dict(layers=4, width=256, heads=4, seq=128),
    "gpt2-medium": dict(layers=24, width=1024, heads=16, seq=1024),
    "bert": dict(layers=4, width=256, heads=4, seq=128),
    "llama": dict(layers=4, width=256, heads=4, seq=128, ffn=0, kv_heads=0, vocab=32000),  # 0: 4 x width, heads
    "vit": dict(layers=4, width=256, heads=4, seq=0),
}


def _transformers(name: str, batch: int, meta_inputs: bool, opts: dict[str, str],
                  dtype: torch.dtype | None = None, on_meta: bool = False) -> Workload:
    try:
        import transformers
    except ImportError as e:  # pragma: no cover
        raise ImportError("transformers specs need transformers: pip install 'remat[hf]'") from e
    if name not in _HF_PRESETS:
        raise ValueError(f"unknown transformers model {name!r}{did_you_mean(name, _HF_PRESETS)}; "
                         f"choose one of {', '.join(sorted(_HF_PRESETS))}")
    unknown = sorted(set(opts) - set(_HF_PRESETS[name]))
    if unknown:
        raise ValueError(f"unknown option {unknown[0]!r} for transformers:{name}"
                         f"{did_you_mean(unknown[0], _HF_PRESETS[name])}; options: {', '.join(_HF_PRESETS[name])}")
    try:
        cfg = {**_HF_PRESETS[name], **{k: int(v) for k, v in opts.items()}}
    except ValueError:
        raise ValueError(f"transformers options are integers, got {opts}") from None
    layers, width, heads, seq = cfg["layers"], cfg["width"], cfg["heads"], cfg["seq"]
    common = dict(attn_implementation="sdpa")
    # a model on meta holds no memory: how a 7B-70B shape is planned on a laptop (remat never
    # needs the weights); built in the training dtype, as mixed-precision-free bf16 training runs
    place = torch.device("meta") if on_meta else contextlib.nullcontext()
    gen = torch.Generator().manual_seed(0)
    device = _input_device(meta_inputs)
    shared: tuple[str, ...] = ()
    if name.startswith("gpt2"):
        config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=heads, n_positions=max(seq, 1024),
                                         use_cache=False, **common)
        with place:
            model = transformers.GPT2LMHeadModel(config)
    elif name == "bert":
        config = transformers.BertConfig(num_hidden_layers=layers, hidden_size=width, num_attention_heads=heads,
                                         intermediate_size=4 * width, max_position_embeddings=max(seq, 512), **common)
        with place:
            model = transformers.BertForMaskedLM(config)
    elif name == "llama":
        config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=width, num_attention_heads=heads,
                                          num_key_value_heads=cfg["kv_heads"] or heads,
                                          intermediate_size=cfg["ffn"] or 4 * width,
                                          max_position_embeddings=max(seq, 2048), vocab_size=cfg["vocab"],
                                          use_cache=False, **common)
        with place:
            model = transformers.LlamaForCausalLM(config)
    else:  # vit
        config = transformers.ViTConfig(num_hidden_layers=layers, hidden_size=width, num_attention_heads=heads,
                                        intermediate_size=4 * width, image_size=224, patch_size=16, **common)
        with place:
            model = transformers.ViTForImageClassification(config)
        if dtype is not None:
            model = model.to(dtype)
        x = (torch.empty(batch, 3, 224, 224, device="meta") if meta_inputs
             else torch.rand(batch, 3, 224, 224, generator=gen))
        return Workload(f"transformers:{name}", model, (x,), about=_about(name, cfg, config, dtype, on_meta))
    if dtype is not None:
        model = model.to(dtype)
    vocab = config.vocab_size
    if meta_inputs:
        ids = torch.empty(batch, seq, dtype=torch.long, device=device)
    else:
        ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    inputs: tuple[Any, ...] = (ids,)
    if name == "bert":
        mask = torch.ones(batch, seq, dtype=torch.long, device=device)
        inputs = (ids, mask)
        shared = ("attention_mask",)
    return Workload(f"transformers:{name}", model, inputs, shared, about=_about(name, cfg, config, dtype, on_meta))


def _about(name: str, cfg: dict[str, int], config: Any, dtype: torch.dtype | None, on_meta: bool) -> str:
    kind = {"gpt2": "GPT-2", "gpt2-medium": "GPT-2", "bert": "BERT", "llama": "Llama", "vit": "ViT"}[name]
    seq = f", seq {cfg['seq']}" if name != "vit" else ", 224 px"
    ffn = getattr(config, "intermediate_size", None) or 4 * cfg["width"]
    extra = f", {str(dtype)[6:]}" if dtype is not None else ""
    return (f"{kind}, {cfg['layers']} layers x {cfg['width']} wide, {cfg['heads']} heads, ffn {ffn}{seq}, vocab "
            f"{getattr(config, 'vocab_size', 0)}{extra}{', built on meta' if on_meta else ''}, random weights")


def _load_factory(module: str, attr: str) -> Any:
    """The factory a spec names, or a ValueError that says what remat looked for."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is not None and module.startswith(e.name):  # the module itself, not one it imports
            raise ValueError(f"cannot import {module!r} for the spec '{module}:{attr}' (looked in the current "
                             f"directory and on sys.path; {FACTORY_CONTRACT})") from None
        raise
    factory = getattr(mod, attr, None)
    if factory is None:
        public = [n for n in vars(mod) if not n.startswith("_")]
        raise ValueError(f"module {module!r} has no attribute {attr!r}{did_you_mean(attr, public)}: "
                         f"{FACTORY_CONTRACT}")
    if not callable(factory):
        raise ValueError(f"{module}:{attr} is a {type(factory).__name__}, not a function: {FACTORY_CONTRACT}")
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin without a signature: let the call say
        return factory
    takes_batch = "batch" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    if not takes_batch:
        raise ValueError(f"{module}:{attr}{inspect.signature(factory)} has no 'batch' parameter: {FACTORY_CONTRACT}")
    return factory


def _factory(module: str, attr: str, batch: int) -> Workload:
    built = _load_factory(module, attr)(batch=batch)
    shape = "only a model" if isinstance(built, nn.Module) else f"a {type(built).__name__}"
    if not isinstance(built, (tuple, list)) or len(built) != 2 or not isinstance(built[0], nn.Module):
        raise ValueError(f"{module}:{attr}(batch={batch}) returned {shape}: {FACTORY_CONTRACT}")
    model, inputs = built
    return Workload(f"{module}:{attr}", model, tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,))


def build(spec: str = DEFAULT_SPEC, batch: int = 4, *, meta_inputs: bool = False, seed: int = 0,
          dtype: torch.dtype | None = None, meta_model: bool = False) -> Workload:
    """Build the model a spec names, with example inputs of batch size ``batch``.

    ``meta_inputs=True`` puts the inputs on the meta device (for profiling big batches with no
    memory).  ``meta_model=True`` builds a transformers model on the meta device too (inputs on
    meta: planning a 7B-70B shape needs no memory); other models are normal CPU models with random
    weights.  ``dtype``: the model's parameters (e.g. torch.bfloat16).
    """
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a positive integer, got {batch!r}")
    parsed = parse_spec(spec)
    torch.manual_seed(seed)
    if parsed.kind == "transformers":
        return _transformers(parsed.name, batch, meta_inputs or meta_model, parsed.options, dtype, meta_model)
    if parsed.kind == "mlp":
        model = ResidualMLP()
        shape = (batch, 256, 512)  # 256 tokens per sample, so activations matter as in a transformer
        x = torch.empty(shape, device="meta") if meta_inputs else torch.randn(shape)
        work = Workload("mlp", model, (x,))
    elif parsed.kind == "torchvision":
        work = _torchvision(parsed.name, batch, meta_inputs)
    else:
        work = _factory(parsed.module, parsed.name, batch)
    if dtype is not None:
        work.model = work.model.to(dtype)
        work.inputs = tuple(x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                            for x in work.inputs)
    return work

"""Model specs as text, without torch: their syntax, and "did you mean" suggestions for typos.

The CLI checks a spec's shape here before anything heavy is imported; ``zoo.build`` then builds
the model it names (and checks the names themselves: torchvision's model list, the transformers
presets, the factory's module and signature).
"""
from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["DEFAULT_SPEC", "KINDS", "Spec", "parse_spec", "did_you_mean", "FACTORY_CONTRACT"]

DEFAULT_SPEC = "mlp"
KINDS = ("torchvision", "transformers")  # the built-in families; anything else before ':' is a module
FACTORY_CONTRACT = "remat calls factory(batch=N) and needs (model, example_inputs) back"
_EXAMPLES = "'mlp', 'torchvision:resnet50', 'transformers:gpt2' or 'package.module:factory'"


@dataclass(frozen=True)
class Spec:
    """One parsed spec: ``kind`` is "mlp", "torchvision", "transformers" or "factory"."""

    text: str
    kind: str
    name: str = ""  # the torchvision/transformers model, or the factory function
    module: str = ""  # the factory's module ("package.module")
    options: dict[str, str] = field(default_factory=dict)


def did_you_mean(word: str, choices: Iterable[str], n: int = 3) -> str:
    """`` (did you mean a or b?)`` for the closest choices, or "" when none is close."""
    close = difflib.get_close_matches(word, list(choices), n=n, cutoff=0.6)
    if not close:
        return ""
    words = close[0] if len(close) == 1 else ", ".join(close[:-1]) + " or " + close[-1]
    return f" (did you mean {words}?)"


def _options(text: str) -> dict[str, str]:
    if not text:
        return {}
    pairs = [p.split("=", 1) for p in text.split(",") if p]
    bad = [p[0] for p in pairs if len(p) != 2]
    if bad:
        raise ValueError(f"model options must be key=value, got {bad}")
    return {k.strip(): v.strip() for k, v in pairs}


def parse_spec(text: str) -> Spec:
    """Split a spec into its parts; a ValueError says what a spec looks like (with a suggestion)."""
    text = text.strip()
    if text in ("mlp", "default"):
        return Spec(text, "mlp")
    head, colon, rest = text.partition(":")
    if not colon or not rest or not head:
        hint = did_you_mean(text, ["mlp"])
        raise ValueError(f"model spec {text!r} must look like {_EXAMPLES}{hint}")
    name, _, opts = rest.partition(":")
    if head in KINDS:
        if head == "torchvision" and opts:
            raise ValueError("torchvision specs take no options: 'torchvision:NAME'")
        return Spec(text, head, name, options=_options(opts))
    close = did_you_mean(head, KINDS)
    if close and "." not in head:
        raise ValueError(f"unknown model family {head!r} in spec {text!r}{close}")
    if opts:
        raise ValueError(f"a factory spec is 'package.module:factory' (no options), got {text!r}")
    if not head.replace(".", "").replace("_", "").isalnum() or not name.isidentifier():
        raise ValueError(f"{text!r} is not 'package.module:factory' ({FACTORY_CONTRACT})")
    return Spec(text, "factory", name, module=head)

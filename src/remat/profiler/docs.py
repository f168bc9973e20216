"""Render the registries as the markdown tables in docs/: FLOP formulas and memory rules.

``python -m remat.profiler.docs > docs/flops.md`` and ``python -m remat.profiler.docs --memory >
docs/memory.md`` regenerate them; a test checks the files match.
"""
from __future__ import annotations

from collections import defaultdict

import torch

from . import flops  # noqa: F401  (fills the registry)
from .formulas_mac import TORCH_COVERED
from .registry import REGISTRY, ZERO_COST
from .rules import RULES, rules_for

HEADER = """# FLOP formulas

Generated from the registry by `python -m remat.profiler.docs`; do not edit by hand.

Conventions: 2 FLOPs per multiply-add for matmul, convolution and attention (exactly
`torch.utils.flop_counter`, whose formulas remat reuses; ✓ marks those ops); every other op counts
one FLOP per element per elementary operation, a transcendental function (exp, log, erf, tanh) being
one operation. N is the number of elements of the op's input, O of its output. In-place (`relu_`)
and `out=` variants share their op's formula. Views and metadata queries are 0 FLOPs. Any other op
that reaches the dispatcher without a formula is listed in `FlopCount.unknown_ops`, warned about once
(`remat.RematWarning`) and estimated at 1 FLOP per element of its largest tensor: never a silent zero.
"""


def render() -> str:
    groups: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for packet, formula in REGISTRY.items():
        name = packet.__name__ + (" ✓" if packet in TORCH_COVERED else "")
        groups[formula.group][formula.doc].append(name)
    out = [HEADER]
    for group in sorted(groups):
        out.append(f"\n## {group}\n\n| ops | FLOPs |\n|---|---|")
        for doc, names in sorted(groups[group].items(), key=lambda kv: sorted(kv[1])[0]):
            out.append(f"| {', '.join(f'`{n}`' for n in sorted(names))} | {doc} |")
    zeros: dict[str, list[str]] = defaultdict(list)
    for packet, reason in ZERO_COST.items():
        zeros[reason].append(packet.__name__)
    out.append("\n## zero FLOPs (data movement and creation)\n\n| ops | why |\n|---|---|")
    for reason, names in sorted(zeros.items()):
        out.append(f"| {', '.join(f'`{n}`' for n in sorted(names))} | {reason} |")
    return "\n".join(out) + "\n"


MEMORY_HEADER = """# Memory rules

Generated from the registry in `src/remat/profiler/rules/` by `python -m remat.profiler.docs --memory`;
do not edit by hand.

Fake tensors already give every op's outputs with their sizes, strides and aliasing, so views and
in-place results cost nothing and new outputs are new storages, exactly as in a real run. This table
lists what they do not show. *scratch* is memory a kernel allocates and frees while it runs: on the
planning machine it is measured op by op (`src/remat/profiler/calibrate.py`); these rules are the
fallback for targets remat cannot run (inputs on meta, another device) and are meant as upper
bounds. *extra_out*: bytes the real outputs hold beyond the fake ones (an RNN workspace), freed with
them. *layout*: the real kernel lays its output out differently. *dropped*: the fake kernel
returns an output the real one does not allocate. *held*: memory allocated outside any op that
lives to the end of the step. *writes*: arguments written although the op's schema does not say so.
*workspace*: memory a library keeps on the device from its first use on (counted as resident bytes
of every step). *granularity*: every allocation on the device is rounded up to a multiple of it.
"""


def render_memory() -> str:
    rules_for(torch.ops.aten.add.Tensor, "*")  # load every rule module
    out = [MEMORY_HEADER, "| device | ops | aspect | what | source |", "|---|---|---|---|---|"]
    rows: dict[tuple[str, str, str, str], list[str]] = defaultdict(list)
    for r in RULES:
        aspects = [a for a in ("scratch", "extra_out", "layout", "dropped", "held", "workspace") if getattr(r, a) is not None]
        aspects += ["writes " + ", ".join(map(str, r.writes))] if r.writes else []
        aspects += [f"granularity {r.granularity}"] if r.granularity else []
        device_wide = r.op is None and (r.workspace is not None or r.granularity)
        name = ("the device" if device_wide else "every op") if r.op is None else str(r.op).removeprefix("aten.")
        rows[(r.device, " ".join(aspects), r.doc, r.source)].append(name)
    for (device, aspect, doc, source), names in sorted(rows.items()):
        out.append(f"| {device} | {', '.join(f'`{n}`' for n in names)} | {aspect} | {doc} | {source} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    import sys

    print(render_memory() if "--memory" in sys.argv[1:] else render(), end="")

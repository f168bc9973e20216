"""Render the FLOP formula registry as the markdown table in docs/flops.md.

``python -m remat.profiler.docs > docs/flops.md`` regenerates it; a test checks the file matches.
"""
from __future__ import annotations

from collections import defaultdict

from . import flops  # noqa: F401  (fills the registry)
from .formulas_mac import TORCH_COVERED
from .registry import REGISTRY, ZERO_COST

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


if __name__ == "__main__":
    print(render(), end="")

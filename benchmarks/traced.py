"""The traced graph is as fast as the model: remat's module at budget 1.0 (no checkpoint) against
eager, per model, in alternated pairs (eager first in even pairs, second in odd ones) so neither the
machine's drift nor the order favours either.  Issue 16's target: <= 1.02x.
Writes benchmarks/results/traced.md.

    python benchmarks/traced.py [--pairs 9] [--models resnet50,vit_b_16,gpt2]
"""
from __future__ import annotations

import argparse
import statistics

import remat
from remat.zoo import build

from common import md_table, write_result
from peers import MODELS, _step


def ratio_row(name: str, pairs: int) -> list[object]:
    spec, batch = MODELS[name]
    work = build(spec, batch)
    gm = remat.checkpoint(work.model, work.inputs, budget=1.0, shared_inputs=work.shared_inputs)
    for module in (work.model, gm):
        _step(module, work.inputs)  # warm-up
    ratios, eager = [], []
    for i in range(pairs):
        if i % 2 == 0:
            a = _step(work.model, work.inputs)
            b = _step(gm, work.inputs)
        else:
            b = _step(gm, work.inputs)
            a = _step(work.model, work.inputs)
        ratios.append(b / a)
        eager.append(a)
    print(f"{name}: traced / eager {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})", flush=True)
    return [f"{name}@{batch}", gm.remat_frontend, f"{statistics.median(eager):.3f} s",
            f"{statistics.median(ratios):.3f}", f"{min(ratios):.3f}-{max(ratios):.3f}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=9)
    ap.add_argument("--models", default=",".join(MODELS))
    a = ap.parse_args()
    rows = [ratio_row(name, a.pairs) for name in a.models.split(",")]
    write_result("traced.md", "The traced graph against the model", [
        f"One training step of remat's module at budget 1.0 (the trace, no checkpoint) over one of the model, "
        f"{a.pairs} alternated pairs per model after a warm-up of each; median ratio and its range. Target <= 1.02.",
        md_table(["model", "frontend", "eager step (median)", "traced / eager", "range"], rows)])


if __name__ == "__main__":
    main()

"""Linearization speed: a 2,000+ node graph must linearize in under a second.

Builds a residual MLP deep enough for 2,000+ graph nodes and gpt2 with 24 layers, profiles them
once on fake tensors, then times `linearize` (median of 5). Writes benchmarks/results/linearize.md.

    python benchmarks/linearize.py
"""
from __future__ import annotations

import sys

import torch

import remat
from remat.chain import linearize
from remat.profiler.model import profile_graph
from remat.zoo import ResidualMLP, build

from common import md_table, median_time, write_result


def case(name, model, inputs):
    gm = remat.trace(model, inputs)
    prof = profile_graph(gm, inputs)
    seconds = median_time(lambda: linearize(gm), repeat=5)
    chain = linearize(gm)
    return [name, len(gm.graph.nodes), len(chain), f"{prof.profile_seconds:.2f}", f"{seconds * 1000:.1f}"], seconds


def main() -> int:
    rows, worst = [], 0.0
    for name, model, inputs in [
        ("residual MLP, 420 blocks", ResidualMLP(width=64, depth=420), (torch.randn(4, 64, device="meta"),)),
        ("gpt2, 24 layers (export)", *(lambda w: (w.model, w.inputs))(build("transformers:gpt2:layers=24", 2))),
    ]:
        row, seconds = case(name, model, inputs)
        rows.append(row)
        worst = max(worst, seconds) if row[1] >= 2000 else worst
        print(" | ".join(map(str, row)), flush=True)
    summary = f"Slowest linearization of a graph with 2,000+ nodes: {worst * 1000:.1f} ms (target < 1000 ms)."
    write_result("linearize.md", "Linearization speed",
                 [summary, md_table(["graph", "nodes", "stages", "profile s", "linearize ms"], rows)])
    print(summary)
    return 0 if worst < 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())

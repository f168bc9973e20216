"""What the keep guard costs: a training step of plans whose every stage keeps its matmul/conv/
attention outputs (torch's selective checkpointing), with remat's guarded policy against the same
policy unguarded, in alternated pairs in one process.

The guard (remat/runtime.py, ``_KeepGuard``) looks at every op of a keeping region's forward for a
write into a kept output; this measures what that adds to a step.

    python benchmarks/guard.py [--pairs 9]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import remat
from remat import runtime
from remat.testing.plans import keeping_everywhere
from remat.zoo import build

from common import md_table, write_result

MODELS = ("transformers:gpt2", "torchvision:resnet18", "mlp")


def step(gm, inputs) -> float:
    for p in gm.parameters():
        p.grad = None
    start = time.perf_counter()
    out = gm(*inputs)
    remat.step.loss_of(out).backward()
    return time.perf_counter() - start


def policy_calls(gm, inputs) -> list[tuple]:
    """Every (ctx, op, args, kwargs) the keeping regions' policy sees in one step."""
    calls: list[tuple] = []
    guarded = runtime._KeepGuard.__call__

    def record(self, ctx, op, *a, **k):
        calls.append((ctx, op, a, k))
        return guarded(self, ctx, op, *a, **k)

    runtime._KeepGuard.__call__ = record
    try:
        step(gm, inputs)
    finally:
        runtime._KeepGuard.__call__ = guarded
    return calls


def per_call_seconds(calls: list[tuple], guard: bool, repeat: int = 20) -> float:
    """Seconds per policy call, guarded (remat's) or the bare policy, over the recorded calls."""
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeat):
            keeper = runtime._KeepGuard("bench")
            for ctx, op, a, k in calls:
                if guard:
                    keeper(ctx, op, *a, **k)
                else:
                    runtime._save_compute(ctx, op, *a, **k)
        best = min(best, (time.perf_counter() - start) / (repeat * max(1, len(calls))))
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=9)
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args(argv)
    guarded = runtime._KeepGuard.__call__
    unguarded = lambda self, ctx, op, *a, **k: runtime._save_compute(ctx, op, *a, **k)  # noqa: E731
    rows = []
    for spec in MODELS:
        work = build(spec, args.batch)
        gm = keeping_everywhere(work.model, work.inputs)
        regions = gm.code.count('save="compute"')
        step(gm, work.inputs)  # warm up
        ratios = []
        for _ in range(args.pairs):
            runtime._KeepGuard.__call__ = unguarded
            off = step(gm, work.inputs)
            runtime._KeepGuard.__call__ = guarded
            on = step(gm, work.inputs)
            ratios.append(on / off)
        runtime._KeepGuard.__call__ = guarded
        calls = policy_calls(gm, work.inputs)
        extra = per_call_seconds(calls, True) - per_call_seconds(calls, False)
        base = statistics.median(step(gm, work.inputs) for _ in range(3))
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        rows.append((spec, regions, len(calls), f"{extra * 1e6:.2f}", f"{len(calls) * extra / base:.4%}",
                     f"{statistics.median(ratios):.3f}", f"{min(ratios):.3f} .. {max(ratios):.3f}",
                     f"{q[0]:.3f} .. {q[2]:.3f}"))
        print(rows[-1], flush=True)
    table = md_table(("model", "keeping regions", "policy calls per step", "guard us per call",
                      "guard share of the step", "guarded / unguarded step (median)", "range", "quartiles"), rows)
    write_result("guard.md", "The keep guard's cost per training step",
                 [f"Batch {args.batch}, {args.pairs} alternated pairs per model, every stage its own region keeping "
                  "its matmul/conv/attention outputs. The guard's share of the step is its extra time per policy "
                  "call (the recorded calls of one step replayed through the guarded and the bare policy, best of "
                  "5) times the calls, over the step's median time: the whole steps' ratio is within the noise of "
                  "2 shared cores.", table])
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

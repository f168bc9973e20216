"""Fuzz soak: random DAG networks checkpointed at random budgets, counted.

Each network (remat.testing.fuzz: convolutions, norms, skips, dropout as a module and in the graph,
attention with dropout, no_grad and autocast blocks, the network's own checkpoint calls) is checkpointed with rotor or chen-greedy at a random budget
fraction in [0.3, 1] (where that is infeasible, at the minimum InfeasibleBudget reports, so the
reported floor is itself tested); one training step is compared with the original (outputs,
gradients, buffers) and the measured peak with the budget. ``--seed k`` draws seeds k*10^6 + i,
so runs with different k test fresh networks. Writes benchmarks/results/fuzz_seed{k}.md.

    python benchmarks/fuzz.py --n 1000 [--seed 0]
"""
from __future__ import annotations

import argparse
import random
import sys
import time
import traceback
from collections import Counter

import torch

import remat
from remat.testing import FuzzNet, assert_same_step, random_spec

from common import write_result


def _checked(model, x, budget, solver) -> tuple[str, str, object]:
    """One training step of the checkpointed model against the original, then its measured peak."""
    try:
        gm = assert_same_step(model, lambda m: remat.checkpoint(m, (x,), budget=budget, solver=solver), (x,))
    except AssertionError as e:
        return "mismatch", str(e).splitlines()[0][:160], None
    measured = remat.measure_peak(gm, (x,))
    if measured > gm.remat_plan.budget_bytes:
        return "overrun", f"measured {measured} > budget {gm.remat_plan.budget_bytes}", None
    return "", "", gm


def one(seed: int) -> tuple[str, str]:
    """Checkpoint a random network at a random budget; where that budget is infeasible, retry at the
    minimum InfeasibleBudget reports, so the reported floor is itself tested (it must fit)."""
    rng = random.Random(seed)
    n = rng.randint(6, 20)
    fraction = rng.uniform(0.3, 1.0)
    solver = rng.choice(["rotor", "chen-greedy"])
    model = FuzzNet(random_spec(rng, n)).train()
    x = torch.randn(8, 8, 32, 32)
    try:
        try:
            outcome, detail, gm = _checked(model, x, fraction, solver)
            label = "fits"
        except remat.InfeasibleBudget as e:
            if e.min_bytes is None:
                return "error", f"InfeasibleBudget without a minimum: {e}"
            outcome, detail, gm = _checked(model, x, int(e.min_bytes), solver)
            label = "fits at the reported floor"
    except remat.InfeasibleBudget as e:
        return "error", f"the reported floor does not fit: {str(e)[:120]}"
    except Exception as e:  # noqa: BLE001
        return "error", f"{type(e).__name__}: {traceback.extract_tb(e.__traceback__)[-1].name}: {str(e)[:120]}"
    if outcome:
        return outcome, detail
    if not gm.remat_plan.regions:
        return label + " (no checkpoint needed)", ""
    # plans keeping matmul/conv/attention outputs run torch's selective checkpoint: counted apart
    return label + (" (selective regions)" if 'save="compute"' in gm.code else ""), ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    counts: Counter[str] = Counter()
    problems = []
    start = time.perf_counter()
    for i in range(args.n):
        seed = args.seed * 1_000_000 + i
        outcome, detail = one(seed)
        counts[outcome] += 1
        if outcome in ("mismatch", "overrun", "error"):
            problems.append(f"seed {seed}: {outcome}: {detail}")
        if (i + 1) % 50 == 0:
            print(f"{i + 1}/{args.n} {dict(counts)}", flush=True)
    seconds = time.perf_counter() - start
    summary = (f"{args.n} random networks (seeds {args.seed * 1_000_000}..{args.seed * 1_000_000 + args.n - 1}) in {seconds:.0f} s: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
               + f". Gradient/output/buffer mismatches: {counts['mismatch']}; budget overruns: {counts['overrun']}; "
               f"other errors: {counts['error']}.")
    severity = {"mismatch": 0, "overrun": 1, "error": 2}
    problems.sort(key=lambda p: severity[p.split(": ")[1]])
    write_result(f"fuzz_seed{args.seed}.md", "Fuzz soak", [summary] + (["Problems:\n\n" + "\n".join(f"- {p}" for p in problems[:50])]
                                                       if problems else []))
    print(summary)
    for p in problems[:20]:
        print(p)
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())

"""Fuzz soak: random DAG networks checkpointed at random budgets, counted.

Each network (remat.testing.fuzz, ``ALL_OPS``: convolutions, norms, skips, dropout as a module and in
the graph, attention with dropout, no_grad and autocast blocks, the network's own checkpoint calls,
recurrent cells and user code that write matmul/conv outputs in place) is checkpointed with a
random solver (rotor, chen-greedy at a random budget fraction in [0.3, 1]; where that is
infeasible, at the minimum InfeasibleBudget reports, so the reported floor is itself tested;
chen-sqrtn, every-stage); one training step is compared with the original (outputs, gradients,
buffers) and the measured peak with the budget.  Then both region kinds by hand: every stage its own
region, keeping its matmul/conv/attention outputs wherever the profile allows, must train exactly
too (whether the solvers choose such regions depends on this machine's op times).  ``--seed k``
draws seeds k*10^6 + i, so runs with different k test fresh networks.  ``--ops base`` draws from
the generator before the in-place ops (``OPS``).  Writes benchmarks/results/fuzz_seed{k}.md.

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
from remat.testing import ALL_OPS, OPS, FuzzNet, assert_same_step, random_spec
from remat.testing.plans import keeping_everywhere

SOLVERS = ("rotor", "chen-greedy", "chen-sqrtn", "every-stage")
# Tensors are compared to within this share of their largest magnitude (the trace check's float32
# tolerance): the CPU's backward sums a gradient over a value's uses in graph order, and a trace can
# order them otherwise.  Seed 2000874 (RNN cells and nn.GRU sharing their input) differed from the
# model by 1e-5 on gradients of magnitude 300-1600 with no checkpoint at all (its plain trace);
# the wrong gradients this fuzz exists to catch are of the tensors' own size (5x on GRUCell chains).
SCALE = 1e-5

from common import write_result


def _checked(model, x, budget, solver) -> tuple[str, str, object]:
    """One training step of the checkpointed model against the original, then its measured peak."""
    try:
        gm = assert_same_step(model, lambda m: remat.checkpoint(m, (x,), budget=budget, solver=solver), (x,),
                              scale=SCALE)
    except AssertionError as e:
        return "mismatch", str(e).splitlines()[0][:160], None
    measured = remat.measure_peak(gm, (x,))
    if gm.remat_plan.budget_bytes is not None and measured > gm.remat_plan.budget_bytes:
        return "overrun", f"measured {measured} > budget {gm.remat_plan.budget_bytes}", None
    return "", "", gm


def keeping_everywhere_exact(model, x) -> tuple[str, str]:
    """Every stage its own region, keeping its matmul/conv/attention outputs unless the profile
    refuses (a later op overwrites one): the step must equal the original's."""
    try:
        gm = assert_same_step(model, lambda m: keeping_everywhere(m, (x,)), (x,), scale=SCALE)
    except AssertionError as e:
        return "mismatch", "keeping everywhere: " + str(e).splitlines()[0][:140]
    refused = len(gm.remat_plan.info.keep_refused)
    return "", f"{len(gm.remat_plan.stages) - refused} keeping, {refused} refused"


def one(seed: int, ops: tuple[str, ...] = ALL_OPS) -> tuple[str, str]:
    """Checkpoint a random network at a random budget; where that budget is infeasible, retry at the
    minimum InfeasibleBudget reports, so the reported floor is itself tested (it must fit).  Then
    the hand-made plan that keeps outputs everywhere the profile allows."""
    rng = random.Random(seed)
    n = rng.randint(6, 20)
    fraction = rng.uniform(0.3, 1.0)
    solver = rng.choice(SOLVERS)
    model = FuzzNet(random_spec(rng, n, ops=ops)).train()
    x = torch.randn(8, 8, 32, 32)
    if solver not in ("rotor", "chen-greedy"):
        fraction = None
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
    try:
        kept, detail = keeping_everywhere_exact(model, x)
    except Exception as e:  # noqa: BLE001
        return "error", f"keeping everywhere: {type(e).__name__}: {str(e)[:120]}"
    if kept:
        return kept, detail
    label = f"{solver}: {label}"
    if not gm.remat_plan.regions:
        return label + " (no checkpoint needed)", detail
    # plans keeping matmul/conv/attention outputs run torch's selective checkpoint: counted apart
    return label + (" (selective regions)" if 'save="compute"' in gm.code else ""), detail


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ops", choices=("all", "base"), default="all")
    args = ap.parse_args(argv)
    ops = ALL_OPS if args.ops == "all" else OPS
    kept = refused = 0
    counts: Counter[str] = Counter()
    problems = []
    start = time.perf_counter()
    for i in range(args.n):
        seed = args.seed * 1_000_000 + i
        outcome, detail = one(seed, ops)
        counts[outcome] += 1
        if detail.endswith(" refused"):
            kept += int(detail.split()[0])
            refused += int(detail.split(", ")[1].split()[0])
        if outcome in ("mismatch", "overrun", "error"):
            problems.append(f"seed {seed}: {outcome}: {detail}")
        if (i + 1) % 50 == 0:
            print(f"{i + 1}/{args.n} {dict(counts)}", flush=True)
    seconds = time.perf_counter() - start
    summary = (f"{args.n} random networks (seeds {args.seed * 1_000_000}..{args.seed * 1_000_000 + args.n - 1}) in {seconds:.0f} s: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
               + f". Gradient/output/buffer mismatches: {counts['mismatch']}; budget overruns: {counts['overrun']}; "
               f"other errors: {counts['error']}. Hand-made plans keeping outputs everywhere allowed: {kept} "
               f"keeping regions, {refused} stages refused (a later op writes a kept output), all exact unless "
               "listed below.")
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

"""The floor is as fast as a plan: InfeasibleBudget and budget="min" against one successful plan.

Per model, the problem is prepared once (trace, profile, linearize: shared by all three), then,
alternated for --pairs rounds: a plan at budget 0.6, a plan at 0.01 (below every floor: it raises
InfeasibleBudget, which carries the floor), and budget="min".  Ratios are per round, against the
0.6 plan of the same round; the table gives their median and spread.  Issue 16's target: the
infeasible answer in <= 2x one successful plan.
Writes benchmarks/results/floor.md.

    python benchmarks/floor.py [--pairs 5] [--quick]
"""
from __future__ import annotations

import argparse
import statistics
import time

from remat.budget import Budget
from remat.errors import InfeasibleBudget
from remat.planner import plan_problem, prepare
from remat.units import fmt_bytes
from remat.zoo import build

from common import md_table, write_result

CASES = [("torchvision:resnet50", 8), ("torchvision:vit_b_16", 4), ("transformers:gpt2:layers=6,width=512,seq=256", 4)]
QUICK = [("mlp", 2), ("torchvision:resnet18", 4)]


def _timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    try:
        out = fn()
    except InfeasibleBudget as e:
        out = e
    return time.perf_counter() - start, out


def rows_for(spec: str, batch: int, pairs: int) -> list[str]:
    work = build(spec, batch)
    problem = prepare(work.model, work.inputs, work.kwargs, work.shared_inputs)
    plan_s, infeasible_r, min_r = [], [], []
    floor = least = None
    for _ in range(pairs):
        t_plan, _ = _timed(lambda: plan_problem(problem, "rotor", Budget(fraction=0.6)))
        t_inf, err = _timed(lambda: plan_problem(problem, "rotor", Budget(fraction=0.01)))
        t_min, res = _timed(lambda: plan_problem(problem, "rotor", Budget(minimum=True)))
        assert isinstance(err, InfeasibleBudget), f"{spec}: budget 0.01 did not raise InfeasibleBudget"
        floor = err.min_bytes
        least = res[1].budget_bytes
        plan_s.append(t_plan)
        infeasible_r.append(t_inf / t_plan)
        min_r.append(t_min / t_plan)

    def spread(r: list[float]) -> str:
        return f"{statistics.median(r):.2f}x ({min(r):.2f}-{max(r):.2f})"

    return [f"{spec.split(':', 1)[-1]}@{batch}", f"{statistics.median(plan_s):.2f} s", spread(infeasible_r),
            spread(min_r), fmt_bytes(floor), fmt_bytes(least)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="two small models")
    args = ap.parse_args()
    rows = [rows_for(spec, batch, args.pairs) for spec, batch in (QUICK if args.quick else CASES)]
    table = md_table(["model", "plan at 0.6 (median)", "InfeasibleBudget / plan", "budget='min' / plan",
                      "floor (InfeasibleBudget)", "budget of the min plan"], rows)
    note = (f"{args.pairs} alternated rounds per model{' (--quick)' if args.quick else ''}; ratios per round "
            "against that round's plan at 0.6, median (min-max).")
    print(note + "\n\n" + table)
    write_result("floor.md", "The floor against one plan", [note, table])


if __name__ == "__main__":
    main()

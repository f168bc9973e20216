"""How much a bigger plan space would buy: rotor's predicted optimum at each peer's peak, with
other keep sets, a finer memory grid and no coarsening.

Issue 30 asks for <= 1.10x eager at the peak of checkpointing every block.  remat's model predicts
its plans there within 0.03 of the measured ratio (benchmarks/peers.py), so what is left is the
plan space.  This script answers with the model: at each peer's predicted peak (every block, every
other block, op-level SAC), the least predicted recomputation (share of the predicted step) of
rotor's plan when
  - regions may keep their matmul/conv/attention outputs (remat's default) or not at all;
  - they keep only matmul/conv outputs, or only attention outputs (an option set per region
    beyond "keep all or none": what a richer DP would choose from, each alone);
  - the DP's memory grid is 4x finer (2000 slots), or the chain is not coarsened (every stage).
Predictions only: nothing is timed, so it runs beside other work (op times come from this
machine's cache; measure them on an idle machine, profiler/timing.py).

    python benchmarks/plan_space.py [--spec torchvision:resnet50 --batch 8 ...] [--uncoarsened]
"""
from __future__ import annotations

import argparse
from collections.abc import Callable

from torch import fx

from remat.budget import parse_budget
from remat.chain import cut_depths, linearize
from remat.planner import apply_regions, plan_problem, prepare
from remat.planner.problem import Granularity, coarsen
from remat.profiler.node import META_KEY
from remat.solvers.registry import SolveSettings
from remat.units import fmt_bytes
from remat.zoo import build

from common import md_table, write_result
from peers import MODELS
from peers_plans import peer_schedules

SPECS = tuple(MODELS.values())  # the models and batches peers.py measures


def _attention(node: fx.Node) -> bool:
    return "attention" in str(node.target)


VARIANTS: tuple[tuple[str, Callable[[fx.Node], bool] | None, bool, int], ...] = (
    # name, which keepable nodes a keeping region keeps (None: all), keeping regions at all, slots
    ("remat (matmul/conv/attention kept)", None, True, 500),
    ("no keeping regions", None, False, 500),
    ("matmul/conv kept, not attention", lambda n: not _attention(n), True, 500),
    ("attention kept only", _attention, True, 500),
    ("remat, 2000 slots", None, True, 2000),
)


def _relinearize(problem, shared: tuple[str, ...], keeps: Callable[[fx.Node], bool] | None, max_stages: int) -> None:
    """Linearize ``problem`` again with only the nodes ``keeps`` accepts kept by a keeping region
    (None: every node its profile marks); the profile's own values stay in node.meta."""
    for node in problem.gm.graph.nodes:
        prof = node.meta[META_KEY]
        full = node.meta.setdefault("plan_space_keep", (prof.keep_bytes, prof.keep_time))
        prof.keep_bytes, prof.keep_time = full if keeps is None or keeps(node) else (0, 0.0)
    for name in list(problem.levels):
        chain = linearize(problem.gm, shared, split_blocks=name == "fine")
        coarse, groups = coarsen(chain.model, max_stages, cut_depths(problem.gm, chain))
        problem.levels[name] = Granularity(name, chain, coarse, groups)
    problem.least_regions.clear()


def space_rows(spec: str, batch: int, uncoarsened: bool) -> list[tuple]:
    work = build(spec, batch)
    problem = prepare(work.model, work.inputs, work.kwargs, work.shared_inputs)
    name = spec.split(":")[1]
    step = sum(n.fwd_time + n.bwd_time for n in problem.profile.nodes)
    level, peers = peer_schedules(problem)
    budgets = {peer: problem.margin.budget_for(problem.predict(apply_regions(problem, regions, level)))
               for peer, regions in peers.items()}
    variants = list(VARIANTS) + ([("remat, not coarsened", None, True, 500)] if uncoarsened else [])
    rows = []
    for variant, keeps, selective, slots in variants:
        _relinearize(problem, work.shared_inputs, keeps, 10**9 if "coarsened" in variant else 128)
        for peer, budget in budgets.items():
            _, plan = plan_problem(problem, "rotor", parse_budget(budget), SolveSettings(slots, selective=selective),
                                   verify=False)
            kept = sum(r.policy != "" for r in plan.regions)
            rows.append((name, peer, fmt_bytes(budget), variant, f"+{plan.info.recompute_seconds / step:.1%}",
                         fmt_bytes(plan.predicted_peak_bytes), f"{len(plan.regions)} ({kept} keeping)"))
            print(rows[-1], flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", action="append", help="model spec (repeatable; default: peers.py's four)")
    ap.add_argument("--batch", type=int, action="append", help="batch per --spec")
    ap.add_argument("--uncoarsened", action="store_true", help="also solve the whole chain (minutes on a Llama)")
    args = ap.parse_args(argv)
    specs = list(zip(args.spec, args.batch or [4] * len(args.spec))) if args.spec else list(SPECS)
    rows = [row for spec, batch in specs for row in space_rows(spec, batch, args.uncoarsened)]
    table = md_table(("model", "at the peak of", "budget", "plan space", "predicted recompute (share of step)",
                      "predicted peak", "regions"), rows)
    write_result("plan_space.md", "What a bigger plan space would buy (remat's own model)",
                 [f"Models: {', '.join(f'{s} (batch {b})' for s, b in specs)}. Each peer's budget is its predicted "
                  "peak plus remat's margin; plans are the stage model's (verify=False). Measured ratios of the "
                  "default plans: peers_schedules.md.", table])
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

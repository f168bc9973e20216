"""The peers' schedules as remat plans: what remat's own model predicts for them, and for the plan
remat chooses at their peak.

Every block checkpointed, every other block, and op-level selective checkpointing on every block
(torchtitan-style: keep matmul/conv/attention outputs) are all points of remat's plan space: a
region per block, recomputed whole or keeping its expensive outputs.  Each is built here as regions
over the fine chain's stages (a block = the stages whose modules lie in it), simulated like any
plan, and compared with rotor's plan at the same predicted peak.  Where remat's model says its plan
is faster and a measurement (benchmarks/peers.py) says the peer is, the time model is what is wrong,
not the search.  Predictions only: nothing is timed, so it runs beside other work.

    python benchmarks/peers_plans.py [--spec transformers:gpt2:layers=6,width=512,heads=8,seq=256 --batch 4 ...]
"""
from __future__ import annotations

import argparse
import re

from remat.budget import parse_budget
from remat.chain import stage_modules
from remat.planner import apply_regions, plan_problem, prepare
from remat.solvers.base import FULL, SAVE_COMPUTE, Region
from remat.solvers.model import recompute_time
from remat.units import fmt_bytes
from remat.errors import InfeasibleBudget
from remat.zoo import build

from common import md_table, write_result

# a module path's block, its first numbered component: "transformer.h.3" of "transformer.h.3.attn",
# "encoder.layers.encoder_layer_0" of its "mlp.0", "layer1.0" of its "downsample.0"
BLOCK = re.compile(r"^(.*?[._]\d+)(?:\.|$)")


def blocks_of(problem) -> dict[str, list[int]]:
    """Fine-chain stages per block, by the module path of their last node."""
    chain = problem.levels["fine" if "fine" in problem.levels else "blocks"].chain
    found: dict[str, list[int]] = {}
    for i, (first, last) in enumerate(stage_modules(problem.gm, chain)):
        m = BLOCK.match(last) or BLOCK.match(first)
        if m:
            found.setdefault(m.group(1), []).append(i)
    return found


SPECS = (("transformers:gpt2:layers=6,width=512,heads=8,seq=256", 4),
         ("transformers:llama:layers=8,width=512,heads=8,seq=512,vocab=8000", 2))


def peer_schedules(problem) -> tuple[str, dict[str, tuple[Region, ...]]]:
    """The peers' schedules as regions over one granularity's stages (its name first)."""
    level = "fine" if "fine" in problem.levels else "blocks"
    blocks = sorted(blocks_of(problem).items(), key=lambda kv: min(kv[1]))
    return level, {
        "every block": tuple(Region(min(s), max(s) + 1) for _, s in blocks),
        "every other block": tuple(Region(min(s), max(s) + 1) for i, (_, s) in enumerate(blocks) if i % 2 == 0),
        "op-level SAC, every block": tuple(Region(min(s), max(s) + 1, (), SAVE_COMPUTE) for _, s in blocks),
    }


def peer_rows(spec: str, batch: int) -> tuple[str, list[tuple]]:
    """Each peer's schedule in remat's model beside rotor's plan at its predicted peak."""
    work = build(spec, batch)
    problem = prepare(work.model, work.inputs, work.kwargs, work.shared_inputs)
    level, peers = peer_schedules(problem)
    model = problem.levels[level].exact
    step = sum(n.fwd_time + n.bwd_time for n in problem.profile.nodes)
    rows = []
    for name, regions in peers.items():
        peak = problem.predict(apply_regions(problem, regions, level))
        try:
            _, plan = plan_problem(problem, "rotor", parse_budget(problem.margin.budget_for(peak)))
        except InfeasibleBudget as e:
            rows.append((spec.split(":")[1], name, len(regions), fmt_bytes(peak),
                         f"+{recompute_time(model, regions) / step:.1%}", f"infeasible (floor {fmt_bytes(e.min_bytes or 0)})",
                         "-", "-"))
            continue
        kept = sum(r.policy != FULL for r in plan.regions)
        rows.append((spec.split(":")[1], name, len(regions), fmt_bytes(peak),
                     f"+{recompute_time(model, regions) / step:.1%}", fmt_bytes(plan.predicted_peak_bytes),
                     f"+{plan.info.recompute_seconds / step:.1%}", f"{len(plan.regions)} ({kept} keeping)"))
        print(rows[-1], flush=True)
    return f"{work.title}, batch {batch}: {len(peers['every block'])} blocks by module path on the {level} chain", rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", action="append", help="model spec (repeatable; default: a GPT-2 and a Llama)")
    ap.add_argument("--batch", type=int, action="append", help="batch per --spec")
    args = ap.parse_args(argv)
    specs = list(zip(args.spec, args.batch or [4] * len(args.spec))) if args.spec else list(SPECS)
    about, rows = [], []
    for spec, batch in specs:
        title, found = peer_rows(spec, batch)
        about.append(f"- {title}")
        rows += found
    table = md_table(("model", "peer schedule", "regions", "predicted peak", "predicted time", "remat at that peak: peak",
                      "predicted time", "remat's regions"), rows)
    write_result("peers_plans.md", "The peers' schedules in remat's own model",
                 ["\n".join(about) + "\n\nPredicted times are recomputation over the step's predicted time; op times "
                  "from this machine's cache (measure on an idle machine: profiler/timing.py). Measured: "
                  "peers_schedules.md (benchmarks/peers.py --only-peers).", table])
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

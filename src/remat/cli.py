"""The ``remat`` command: flops | profile | plan | sweep, on models named by a zoo spec."""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from . import zoo
from .solvers.registry import DEFAULT_SLOTS, SOLVERS

__all__ = ["main"]


def _add_model_args(p: argparse.ArgumentParser, *, spec_optional: bool = False) -> None:
    p.add_argument("spec", nargs="?" if spec_optional else None, default=zoo.DEFAULT_SPEC if spec_optional else None,
                   help="model spec: torchvision:NAME, transformers:gpt2|bert|llama|vit[:k=v,...], "
                        f"package.module:factory, or '{zoo.DEFAULT_SPEC}' (default model)")
    p.add_argument("--batch", type=int, default=4, help="batch size of the example inputs (default 4)")


def _cmd_flops(args: argparse.Namespace) -> int:
    from .profiler import count_flops

    work = zoo.build(args.spec, args.batch, meta_inputs=True)
    start = time.perf_counter()
    count = count_flops(work.model, work.inputs, work.kwargs)
    elapsed = time.perf_counter() - start
    print(f"{work.name}  batch {args.batch}  (counted on fake tensors in {elapsed:.2f} s)\n")
    print(count.table(top=args.top))
    return 0


def _cmd_profile(args: argparse.Namespace) -> int:
    from .api import profile
    from .measure import measure_peak
    from .units import fmt_bytes

    work = zoo.build(args.spec, args.batch, meta_inputs=not args.measure)
    prof = profile(work.model, work.inputs, work.kwargs)
    print(f"{work.name}  batch {args.batch}  traced with {prof.frontend}, profiled on fake tensors "
          f"in {prof.profile_seconds:.2f} s\n")
    print(prof.table(top=args.top))
    if args.measure:
        measured = measure_peak(work.model, work.inputs, work.kwargs)
        err = 100.0 * (prof.peak_bytes - measured) / measured
        print(f"measured peak  {fmt_bytes(measured):>12}    error          {err:+11.2f} %")
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from .budget import parse_budget
    from .measure import measure_peak
    from .planner import plan_problem, prepare
    from .solvers.registry import SolveSettings
    from .units import fmt_bytes

    if args.sharding and args.measure:
        raise ValueError("--measure runs one process's step: a sharded step needs its process group "
                         "(see benchmarks/fsdp.py for a 2-process measurement)")
    work = zoo.build(args.spec, args.batch)
    start = time.perf_counter()
    problem = prepare(work.model, work.inputs, work.kwargs, work.shared_inputs,
                      world_size=args.world_size, sharding=args.sharding)
    budget = None if args.budget is None else parse_budget(args.budget)
    gm, plan = plan_problem(problem, args.solver, budget, SolveSettings(slots=args.slots))
    print(f"{work.name}  batch {args.batch}  traced with {problem.profile.frontend}; unconstrained peak "
          f"{fmt_bytes(problem.unconstrained)}, fixed {fmt_bytes(problem.fixed)}; planned in "
          f"{time.perf_counter() - start:.1f} s\n")
    print(plan.describe())
    if args.measure:
        measured = measure_peak(gm, work.inputs, work.kwargs)
        verdict = "" if plan.budget_bytes is None else ("  (within budget)" if measured <= plan.budget_bytes
                                                        else "  (OVER BUDGET)")
        print(f"measured peak   {fmt_bytes(measured):>12}{verdict}")
    if args.code:
        with open(args.code, "w") as f:
            f.write(gm.code)
        print(f"wrote the generated forward to {args.code}")
    if args.save:
        plan.to_json(args.save)
        print(f"saved the plan to {args.save}")
    return 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    from .sweep import draw_pareto, sweep, sweep_table

    work = zoo.build(args.spec, args.batch)
    rows = sweep(work.model, work.inputs, work.kwargs, work.shared_inputs, points=args.points, progress=True)
    print(sweep_table(rows))
    if args.plot:
        draw_pareto(rows, args.plot, title=f"{work.name}, batch {args.batch}")
        print(f"wrote {args.plot}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="remat", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("flops", help="forward/backward FLOPs and MACs of a training step, top ops")
    _add_model_args(p)
    p.add_argument("--top", type=int, default=10, help="how many ops to list (default 10)")
    p.set_defaults(run=_cmd_flops)

    p = sub.add_parser("profile", help="per-node memory and FLOPs, predicted peak of a training step")
    _add_model_args(p)
    p.add_argument("--measure", action="store_true", help="also run one real step and show the measured peak")
    p.add_argument("--top", type=int, default=None, help="show only the K nodes with the most memory")
    p.set_defaults(run=_cmd_profile)

    p = sub.add_parser("plan", help="checkpoint a model under a budget and show the plan")
    _add_model_args(p, spec_optional=True)
    p.add_argument("--budget", default="50%", help="bytes, a size ('2GiB'), or a fraction ('50%%', '0.5'); "
                                                   "default 50%%")
    p.add_argument("--solver", default="rotor", choices=list(SOLVERS),
                   help="; ".join(f"{name}: {s.help}" for name, s in SOLVERS.items()))
    p.add_argument("--slots", type=int, default=DEFAULT_SLOTS,
                   help=f"memory slots of the rotor table (default {DEFAULT_SLOTS})")
    p.add_argument("--code", help="write the generated forward code to this file")
    p.add_argument("--save", help="save the plan as JSON (reapply with remat.apply_plan)")
    p.add_argument("--measure", action="store_true", help="run one real step and report its measured peak")
    p.add_argument("--sharding", choices=["fsdp"], default=None,
                   help="plan one process of FSDP2 training (remat.fully_shard); --batch is per process")
    p.add_argument("--world-size", type=int, default=1, help="processes sharing the parameters (with --sharding)")
    p.set_defaults(run=_cmd_plan)

    p = sub.add_parser("sweep", help="every solver over budgets from the minimum to unconstrained")
    _add_model_args(p)
    p.add_argument("--points", type=int, default=8, help="budgets per solver (default 8)")
    p.add_argument("--plot", help="draw peak memory vs recompute to this PNG (needs matplotlib)")
    p.set_defaults(run=_cmd_sweep)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .errors import RematError

    try:
        return args.run(args)
    except RematError as e:
        print(f"remat: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except (ValueError, ImportError, TypeError) as e:
        print(f"remat: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

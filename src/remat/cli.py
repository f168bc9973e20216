"""The ``remat`` command: flops | profile | plan | sweep, on models named by a zoo spec.

Only argparse and torch-free modules are imported at the top, so ``remat --help`` answers at once;
each command imports what it needs.  Arguments are checked before any model is built: a bad
budget, batch or spec costs no tracing.
"""
from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, NoReturn

from . import progress
from .budget import Budget, parse_budget
from .solvers.registry import DEFAULT_SLOTS, SOLVERS
from .specs import DEFAULT_SPEC, parse_spec

__all__ = ["main", "build_parser", "PROFILE_COLUMNS"]

log = logging.getLogger(__name__)

# What the columns of ``remat profile``'s table mean (profiler/node.py, NodeProfile).
PROFILE_COLUMNS = """\
columns: fwd/bwd FLOPs   work of the node's forward and of its backward
         fwd_in          the node's inputs that autograd saves for its backward
         fwd_tmp         tensors made inside the node (not its outputs) saved for its backward
         fwd_out         new memory of the node's outputs (views and in-place results add none)
         bwd_tmp         the largest temporary memory its backward needs beyond its inputs and outputs
         bwd_out         the gradients its backward returns for its (non-parameter) inputs"""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line that says where to read more."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _budget(text: str) -> Budget:
    try:
        return parse_budget(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _spec(text: str) -> str:
    try:
        parse_spec(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _needs_matplotlib(flag: str, value: str | None) -> None:
    if value and importlib.util.find_spec("matplotlib") is None:
        raise ImportError(f"{flag} draws with matplotlib: pip install 'remat[plot]'")


def _build(args: argparse.Namespace, meta_inputs: bool = False) -> Any:
    from . import zoo

    with progress.step("build model", args.spec):
        return zoo.build(args.spec, args.batch, meta_inputs=meta_inputs)


def _check_measure_device(args: argparse.Namespace) -> None:
    """--measure runs the model where it is built (the CPU): refuse to compare it with a GPU plan."""
    if getattr(args, "measure", False) and getattr(args, "device", None) == "cuda":
        raise ValueError("--measure runs one real step on the CPU, where the zoo builds the model; a --device cuda "
                         "plan is measured on a GPU by benchmarks/cuda.py")


# --- commands ---------------------------------------------------------------------------------------
def _cmd_flops(args: argparse.Namespace) -> int:
    from .profiler import count_flops

    work = _build(args, meta_inputs=True)
    start = time.perf_counter()
    with progress.step("count FLOPs"):
        count = count_flops(work.model, work.inputs, work.kwargs)
    elapsed = time.perf_counter() - start
    print(f"{work.name}  batch {args.batch}  (counted on fake tensors in {elapsed:.2f} s)\n")
    print(count.table(top=args.top))
    return 0


def _cmd_profile(args: argparse.Namespace) -> int:
    from .api import profile
    from .measure import measure_peak
    from .units import fmt_bytes

    _check_measure_device(args)
    work = _build(args, meta_inputs=not args.measure)
    prof = profile(work.model, work.inputs, work.kwargs, device=args.device)
    on = f" for {args.device}" if args.device else ""
    print(f"{work.name}  batch {args.batch}  traced with {prof.frontend}, profiled{on} on fake tensors "
          f"in {prof.profile_seconds:.2f} s\n")
    print(prof.table(top=args.top))
    if args.measure:
        with progress.step("measure"):
            measured = measure_peak(work.model, work.inputs, work.kwargs)
        err = 100.0 * (prof.peak_bytes - measured) / measured
        print(f"measured peak  {fmt_bytes(measured):>12}    error          {err:+11.2f} %")
    print()
    print(PROFILE_COLUMNS)
    return 0


def _early_floor(problem: Any, solver_name: str, slots: int) -> int | None:
    """The solver's floor under the stage model, less what its memory slots may round away: no
    verified plan lies below it (the planner's own floor search starts there).  None without one."""
    from .planner import model_floor
    from .solvers.registry import SolveSettings, get_solver

    solver = get_solver(solver_name)
    if not solver.budgeted or solver.least is None:
        return None
    with progress.step("floor"):
        floor = model_floor(problem, solver, SolveSettings(slots=slots))
    return floor - 2 * max(1, problem.unconstrained - problem.resident) // slots


def _below_floor(work: Any, args: argparse.Namespace, budget_bytes: int, floor: int, fixed: int,
                 unconstrained: int, verified: bool) -> str:
    """The one line the CLI prints when the budget is below what checkpointing reaches."""
    from .units import fmt_bytes

    fraction = min(1.0, (floor - fixed) / max(1, unconstrained - fixed))
    shown = f"{args.budget.fraction:g}" if args.budget.fraction is not None else fmt_bytes(budget_bytes)
    where = f"{work.name} at batch {args.batch}"
    if fraction >= 1.0:
        return (f"budget {shown} ({fmt_bytes(budget_bytes)}) is below what checkpointing can reach for {where}: the "
                f"step's peak ({fmt_bytes(unconstrained)}) comes where little but parameters and gradients is alive, "
                "so no plan lowers it; run with --budget 1.0 (the step as it is), or a larger batch")
    head = f"budget {shown} ({fmt_bytes(budget_bytes)}) is below what checkpointing can reach for {where}: "
    if not verified:  # the stage model's floor: no plan lies below it, the verified one may lie a little above
        return (head + f"the smallest feasible budget is at least {fraction:.3f} ({fmt_bytes(floor)}); run with "
                "--budget min to plan at the smallest one")
    rounded = min(1.0, int(fraction * 1000 + 1) / 1000)
    return (head + f"the smallest feasible budget is {fraction:.3f} ({fmt_bytes(floor)}); run with --budget "
            f"{rounded:g} or --budget min")


def _cmd_plan(args: argparse.Namespace) -> int:
    from .errors import InfeasibleBudget
    from .measure import measure_peak, measure_series
    from .planner import plan_problem, prepare
    from .solvers.registry import SolveSettings, get_solver
    from .units import fmt_bytes

    solver = get_solver(args.solver)
    if args.sharding and args.measure:
        raise ValueError("--measure runs one process's step: a sharded step needs its process group "
                         "(see benchmarks/fsdp.py for a 2-process measurement)")
    if args.sharding and args.timeline:
        raise ValueError("--timeline draws one unsharded step; plan without --sharding to see it")
    if args.budget.minimum and not solver.budgeted:
        raise ValueError(f"--budget min needs a solver that plans under a budget "
                         f"({', '.join(n for n, s in SOLVERS.items() if s.budgeted)}), not {args.solver}")
    _needs_matplotlib("--timeline", args.timeline)
    _check_measure_device(args)
    work = _build(args)
    start = time.perf_counter()
    problem = prepare(work.model, work.inputs, work.kwargs, work.shared_inputs,
                      world_size=args.world_size, sharding=args.sharding, device=args.device)
    budget: Budget = args.budget  # a fixed solver's plan is checked against it too
    if solver.budgeted and not budget.minimum:
        budget_bytes = budget.resolve(problem.fixed, problem.unconstrained)
        floor = _early_floor(problem, args.solver, args.slots) if budget_bytes < problem.unconstrained else None
        log.debug("budget %d bytes, early floor %s", budget_bytes, floor)
        if floor is not None and budget_bytes < floor:
            raise InfeasibleBudget(_below_floor(work, args, budget_bytes, floor, problem.fixed, problem.unconstrained,
                                                verified=False))
    settings = SolveSettings(slots=args.slots)
    try:
        with progress.step("plan", f"{args.solver}, budget {budget}"):
            gm, plan = plan_problem(problem, args.solver, budget, settings)
    except InfeasibleBudget as e:
        if e.min_bytes is None or budget.minimum or not solver.budgeted:
            raise
        budget_bytes = budget.resolve(problem.fixed, problem.unconstrained)
        raise InfeasibleBudget(_below_floor(work, args, budget_bytes, e.min_bytes, problem.fixed,
                                            problem.unconstrained, verified=True), e.min_bytes, e.min_fraction) from None
    print(f"{work.name}  batch {args.batch}  traced with {problem.profile.frontend}; unconstrained peak "
          f"{fmt_bytes(problem.unconstrained)}, fixed {fmt_bytes(problem.fixed)}; planned in "
          f"{time.perf_counter() - start:.1f} s\n")
    print(plan.describe())
    measured_curve = None
    if args.measure:
        with progress.step("measure"):
            if args.timeline:
                measured_curve = measure_series(gm, work.inputs, work.kwargs)
                measured = max(measured_curve)
            else:
                measured = measure_peak(gm, work.inputs, work.kwargs)
        verdict = "" if plan.budget_bytes is None else ("  (within budget)" if measured <= plan.budget_bytes
                                                        else "  (OVER BUDGET)")
        print(f"measured peak   {fmt_bytes(measured):>12}{verdict}")
    if args.code:
        from .standalone import write_module

        write_module(gm, args.code, work.model, spec=work.name, batch=args.batch)
        print(f"wrote a runnable module to {args.code} (its load(model) attaches the plan to your model)")
    if args.save:
        plan.to_json(args.save)
        print(f"saved the plan to {args.save}")
    if args.timeline:
        from .timeline import draw_timeline, plan_timeline

        with progress.step("timeline"):
            data = plan_timeline(problem, gm, plan)
            draw_timeline(data, args.timeline, title=f"{work.name}, batch {args.batch}", measured=measured_curve)
        print(f"drew predicted memory over the step to {args.timeline}")
    return 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    from .sweep import draw_pareto, sweep, sweep_table

    _needs_matplotlib("--plot", args.plot)
    _check_measure_device(args)
    work = _build(args)
    result = sweep(work.model, work.inputs, work.kwargs, work.shared_inputs, points=args.points,
                   progress=progress.enabled(), measure=args.measure, device=args.device)
    print(sweep_table(result.rows))
    if args.plot:
        budget = None if args.budget is None else args.budget.resolve(result.fixed_bytes, result.unconstrained_bytes)
        draw_pareto(result, args.plot, title=f"{work.name}, batch {args.batch}", budget_bytes=budget)
        print(f"wrote {args.plot}")
    return 0


# --- the parser -------------------------------------------------------------------------------------
def _common() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="log what remat does (DEBUG on the 'remat' logger) to stderr")
    return p


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", nargs="?", default=DEFAULT_SPEC, type=_spec,
                   help="the model: torchvision:NAME, transformers:gpt2|gpt2-medium|bert|llama|vit[:k=v,...], "
                        f"package.module:factory (called as factory(batch=N), returning (model, example_inputs); "
                        f"the current directory is searched), or '{DEFAULT_SPEC}' (the default: a residual MLP)")
    p.add_argument("--batch", type=_positive_int, default=4, metavar="N",
                   help="batch size of the example inputs (default 4)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, metavar="DEV",
                   help="cpu or cuda, the device the training step will run on: cuda predicts a GPU step (its "
                        "kernels and caching allocator) on fake tensors, no GPU needed (default: where the model "
                        "is built, the CPU)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="remat", description=__doc__.split("\n", 1)[0],
                     epilog="remat COMMAND --help shows a command's options; docs/design.md says how remat works")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = [_common()]

    p = sub.add_parser("flops", parents=common, help="forward/backward FLOPs and MACs of a training step, top ops",
                       description="Count the FLOPs of one training step on fake tensors (no memory needed).")
    _add_model_args(p)
    p.add_argument("--top", type=_positive_int, default=10, metavar="K",
                   help="list the K ops with the most FLOPs, forward and backward together (default 10)")
    p.set_defaults(run=_cmd_flops)

    p = sub.add_parser("profile", parents=common, help="per-node memory and FLOPs, predicted peak of a training step",
                       description="Profile one training step on fake tensors: per-node memory and FLOPs and the "
                                   "predicted peak; the columns are explained under the table.")
    _add_model_args(p)
    p.add_argument("--measure", action="store_true", help="also run one real step and show the measured peak")
    p.add_argument("--top", type=_positive_int, default=None, metavar="K",
                   help="show only the K nodes that keep the most memory after their forward (fwd_in + fwd_tmp + "
                        "fwd_out), largest first (default: every node, in graph order)")
    p.set_defaults(run=_cmd_profile)

    p = sub.add_parser("plan", parents=common, help="checkpoint a model under a budget and show the plan",
                       description="Plan where to checkpoint so one training step fits the budget; show the plan, "
                                   "and optionally measure it, write its code, save it or draw its memory.")
    _add_model_args(p)
    p.add_argument("--budget", default=parse_budget("50%"), type=_budget,
                   help="bytes, a size ('2GiB', '800MB'), a fraction of what checkpointing can save ('50%%', "
                        "'0.5': fixed + f x (unconstrained - fixed)), or 'min' (the smallest that fits); default 50%%")
    p.add_argument("--solver", default="rotor", choices=list(SOLVERS), metavar="NAME",
                   help="how to choose the regions (default rotor): "
                        + "; ".join(f"{name}: {s.help}" for name, s in SOLVERS.items()))
    p.add_argument("--slots", type=_positive_int, default=DEFAULT_SLOTS, metavar="S",
                   help=f"memory resolution of the rotor table: budget / S per slot (default {DEFAULT_SLOTS})")
    p.add_argument("--code", metavar="FILE.py",
                   help="write a runnable module: the generated forward and load(model), which attaches it to "
                        "your model")
    p.add_argument("--save", metavar="FILE.json", help="save the plan as JSON (reapply with remat.apply_plan)")
    p.add_argument("--measure", action="store_true", help="run one real step and report its measured peak")
    p.add_argument("--timeline", metavar="FILE.png",
                   help="draw predicted memory over the step, original and planned, with the budget and the "
                        "checkpoint regions (and the measured curve with --measure); needs matplotlib")
    p.add_argument("--sharding", choices=["fsdp"], default=None,
                   help="plan one process of FSDP2 training (remat.fully_shard); --batch is per process")
    p.add_argument("--world-size", type=_positive_int, default=1, metavar="N",
                   help="processes sharing the parameters (with --sharding; default 1)")
    p.set_defaults(run=_cmd_plan)

    p = sub.add_parser("sweep", parents=common, help="every solver over budgets from the minimum to unconstrained",
                       description="Plan with every solver at budgets from the smallest feasible one up to the "
                                   "unconstrained step; print the table and optionally draw it.")
    _add_model_args(p)
    p.add_argument("--points", type=_positive_int, default=8, metavar="P",
                   help="budgets per budgeted solver (default 8)")
    p.add_argument("--plot", metavar="FILE.png",
                   help="draw peak memory vs recompute to this PNG (needs matplotlib)")
    p.add_argument("--measure", action="store_true", help="also run each plan for real and plot its measured peak")
    p.add_argument("--budget", type=_budget, default=None,
                   help="draw this budget as a line on the plot (bytes, a size or a fraction)")
    p.set_defaults(run=_cmd_sweep)
    return parser


def _configure(args: argparse.Namespace) -> None:
    """Progress on a terminal unless -q; -v: remat's DEBUG log on stderr (remat's logger only)."""
    if args.verbose:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("remat: %(relativeCreated)7.0f ms %(name)s: %(message)s"))
        logger = logging.getLogger("remat")
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
    elif not args.quiet and sys.stderr.isatty():
        progress.enable(sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, or a usage error (already printed): its exit status
        return int(e.code or 0) if not isinstance(e.code, str) else 2
    if getattr(args, "budget", None) is not None and args.budget.minimum and args.command == "sweep":
        print("remat sweep: error: --budget draws a line: give bytes, a size or a fraction, not 'min'",
              file=sys.stderr)
        return 2
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # factory specs in the current directory (`remat` the script lacks it)
    _configure(args)
    from .errors import RematError

    try:
        return args.run(args)
    except RematError as e:
        print(f"remat: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except (ValueError, ImportError, TypeError) as e:
        print(f"remat: error: {e}", file=sys.stderr)
        return 2
    finally:
        progress.disable()


if __name__ == "__main__":
    sys.exit(main())

"""What each ``remat`` command does once its arguments are parsed (main.py): build the model, run the
pipeline, print.  Torch-free at import, like main.py: each command imports what it needs."""
from __future__ import annotations

import argparse
import importlib.util
import logging
import time
from typing import Any

from .. import progress
from ..budget import Budget, parse_budget
from ..solvers.registry import SOLVERS

__all__ = ["cmd_flops", "cmd_profile", "cmd_plan", "cmd_sweep", "PROFILE_COLUMNS"]

log = logging.getLogger(__name__)

# What the columns of ``remat profile``'s table mean (profiler/node.py, NodeProfile).
PROFILE_COLUMNS = """\
columns: fwd/bwd FLOPs   work of the node's forward and of its backward
         fwd_in          the node's inputs that autograd saves for its backward
         fwd_tmp         tensors made inside the node (not its outputs) saved for its backward
         fwd_out         new memory of the node's outputs (views and in-place results add none)
         bwd_tmp         the largest temporary memory its backward needs beyond its inputs and outputs
         bwd_out         the gradients its backward returns for its (non-parameter) inputs"""


def _needs_matplotlib(flag: str, value: str | None) -> None:
    if value and importlib.util.find_spec("matplotlib") is None:
        raise ImportError(f"{flag} draws with matplotlib: pip install 'remat[plot]'")


def _build(args: argparse.Namespace, meta_inputs: bool = False) -> Any:
    import torch

    from .. import zoo

    spec = args.spec
    seq = getattr(args, "seq", None)
    if seq is not None:
        if not spec.startswith("transformers:"):
            raise ValueError(f"--seq sets a transformers model's sequence length; {spec!r} is not one")
        name, _, options = spec.partition(":")[2].partition(":")
        options = ",".join([o for o in options.split(",") if o and not o.startswith("seq=")] + [f"seq={seq}"])
        spec = f"transformers:{name}:{options}"
    dtype = getattr(torch, args.dtype) if getattr(args, "dtype", None) else None
    meta_model = (getattr(args, "meta", False) or getattr(args, "device", None) == "cuda") \
        and not getattr(args, "measure", False)
    with progress.step("build model", spec):
        return zoo.build(spec, args.batch, meta_inputs=meta_inputs, dtype=dtype, meta_model=meta_model)


def _check_measure_device(args: argparse.Namespace) -> None:
    """--measure runs the model where it is built (the CPU): refuse to compare it with a GPU plan."""
    if getattr(args, "measure", False) and getattr(args, "device", None) == "cuda":
        raise ValueError("--measure runs one real step on the CPU, where the zoo builds the model; a --device cuda "
                         "plan is measured on a GPU by benchmarks/cuda.py")


def cmd_flops(args: argparse.Namespace) -> int:
    from ..profiler import count_flops

    work = _build(args, meta_inputs=True)
    start = time.perf_counter()
    with progress.step("count FLOPs"):
        count = count_flops(work.model, work.inputs, work.kwargs)
    elapsed = time.perf_counter() - start
    print(f"{work.title}  batch {args.batch}  (counted on fake tensors in {elapsed:.2f} s)\n")
    print(count.table(top=args.top))
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from ..api import profile
    from ..measure import measure_peak
    from ..units import fmt_bytes

    _check_measure_device(args)
    work = _build(args, meta_inputs=not args.measure)
    prof = profile(work.model, work.inputs, work.kwargs, device=args.device)
    on = f" for {args.device}" if args.device else ""
    print(f"{work.title}  batch {args.batch}  traced with {prof.frontend}, profiled{on} on fake tensors "
          f"in {prof.profile_seconds:.2f} s")
    if args.device == "cuda":
        print("kernel scratch: bounded by remat's CUDA rules (no GPU kernels run here)\n")
    elif args.measure:
        print("kernel scratch: measured on this CPU, op signature by op signature (real inputs)\n")
    else:
        print("kernel scratch: bounded by remat's rules (inputs on meta: no kernel runs; --measure profiles real "
              "inputs, measures the kernels, and predicts a little lower)\n")
    print(prof.table(top=args.top))
    if args.measure:
        with progress.step("measure"):
            measured = measure_peak(work.model, work.inputs, work.kwargs)
        err = 100.0 * (prof.peak_bytes - measured) / measured
        print(f"measured peak  {fmt_bytes(measured):>12}    error          {err:+11.2f} %")
    print()
    print(PROFILE_COLUMNS)
    return 0


def _below_floor(work: Any, args: argparse.Namespace, budget_bytes: int, floor: int, fixed: int,
                 unconstrained: int, verified: bool) -> str:
    """The one line the CLI prints when the budget is below what checkpointing reaches."""
    from ..units import fmt_bytes

    fraction = min(1.0, (floor - fixed) / max(1, unconstrained - fixed))
    shown = f"{args.budget.fraction:g}" if args.budget.fraction is not None else fmt_bytes(budget_bytes)
    where = f"{work.name} at batch {args.batch}"
    if fraction >= 1.0:
        return (f"budget {shown} ({fmt_bytes(budget_bytes)}) is below what checkpointing can reach for {where}: the "
                f"step's peak ({fmt_bytes(unconstrained)}) comes where nothing a checkpoint drops is alive (among the "
                "parameters and their gradients, or inside one op or node no checkpoint splits), so no plan lowers "
                "it; run with --budget 1.0 (the step as it is), or a larger batch")
    head = f"budget {shown} ({fmt_bytes(budget_bytes)}) is below what checkpointing can reach for {where}: "
    if not verified:  # the bound: no plan lies below it, the verified floor lies above
        return (head + f"no checkpointing of this model's code goes below {fraction:.3f} ({fmt_bytes(floor)}), and "
                "remat's smallest plan lies above that; run with --budget min to plan at the smallest one")
    rounded = min(1.0, int(fraction * 1000 + 1) / 1000)
    return (head + f"the smallest feasible budget is {fraction:.3f} ({fmt_bytes(floor)}); run with --budget "
            f"{rounded:g} or --budget min")


def cmd_plan(args: argparse.Namespace) -> int:
    from ..errors import InfeasibleBudget
    from ..measure import measure_peak, measure_series
    from ..planner import plan_problem, prepare
    from ..solvers.registry import SolveSettings, get_solver
    from ..units import fmt_bytes

    solver = get_solver(args.solver)
    if args.sharding and args.measure:
        raise ValueError("--measure runs one process's step: a sharded step needs its process group "
                         "(see benchmarks/fsdp.py for a 2-process measurement)")
    if args.sharding and args.timeline:
        raise ValueError("--timeline draws one unsharded step; plan without --sharding to see it")
    chosen = args.budget is None  # the default: 50%, or the floor where 50% is below it (said so)
    args.budget = (parse_budget("50%") if solver.budgeted else None) if chosen else args.budget
    if args.budget is not None and args.budget.minimum and not solver.budgeted:
        raise ValueError(f"--budget min needs a solver that plans under a budget "
                         f"({', '.join(n for n, s in SOLVERS.items() if s.budgeted)}), not {args.solver}")
    _needs_matplotlib("--timeline", args.timeline)
    _check_measure_device(args)
    work = _build(args)
    start = time.perf_counter()
    problem = prepare(work.model, work.inputs, work.kwargs, work.shared_inputs,
                      world_size=args.world_size, sharding=args.sharding, device=args.device)
    budget: Budget | None = args.budget  # a fixed solver's plan is checked against it too
    if solver.budgeted and not budget.minimum:
        # Refused before solving only under the bound no checkpointing goes below (the profile's
        # own, a true lower bound); above it the planner finds the verified floor itself.  (The
        # stage model's least-memory plan is no such bound: it over-estimates what the generated
        # module needs, and refused a factory model at 0.51 that plans at 0.49.)
        budget_bytes = budget.resolve(problem.fixed, problem.unconstrained)
        bound = problem.bound.bytes if problem.bound is not None else None
        log.debug("budget %d bytes, bound %s", budget_bytes, bound)
        if bound is not None and budget_bytes < bound:
            if not chosen:
                raise InfeasibleBudget(_below_floor(work, args, budget_bytes, bound, problem.fixed,
                                                    problem.unconstrained, verified=False))
            print(f"the default budget, 50% ({fmt_bytes(budget_bytes)}), is below what any checkpointing reaches for "
                  f"{work.name} at batch {args.batch}; planning at the smallest budget that fits (--budget min); "
                  "--budget chooses another\n")
            budget = parse_budget("min")
    settings = SolveSettings(slots=args.slots)
    try:
        with progress.step("plan", f"{args.solver}, budget {budget}"):
            gm, plan = plan_problem(problem, args.solver, budget, settings)
    except InfeasibleBudget as e:
        if e.min_bytes is None or budget is None or budget.minimum or not solver.budgeted:
            raise
        budget_bytes = budget.resolve(problem.fixed, problem.unconstrained)
        if not chosen:
            raise InfeasibleBudget(_below_floor(work, args, budget_bytes, e.min_bytes, problem.fixed,
                                                problem.unconstrained, verified=True), e.min_bytes,
                                   e.min_fraction) from None
        # the default budget is below what checkpointing reaches here: plan at the floor, and say so
        print(f"the default budget, 50% ({fmt_bytes(budget_bytes)}), is below what checkpointing reaches for "
              f"{work.name} at batch {args.batch}; planning at the smallest budget that fits, {e.min_fraction:.3f} "
              f"({fmt_bytes(e.min_bytes)}); --budget chooses another\n")
        budget = parse_budget(int(e.min_bytes))
        with progress.step("plan", f"{args.solver}, budget {budget}"):
            gm, plan = plan_problem(problem, args.solver, budget, settings)
    print(f"{work.title}  batch {args.batch}  traced with {problem.profile.frontend}; unconstrained peak "
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
        from ..timeline import draw_timeline, problem_timeline

        with progress.step("timeline"):
            data = problem_timeline(problem, gm, plan)
            draw_timeline(data, args.timeline, title=f"{work.name}, batch {args.batch}", measured=measured_curve)
        print(f"drew predicted memory over the step to {args.timeline}")
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
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

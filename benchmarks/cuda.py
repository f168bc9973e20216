"""CUDA plans against a real GPU: predicted (planned on fake tensors) vs measured peak, and gradients.

For each workload the model is built on the CPU (random weights from a config: nothing is
downloaded), planned with ``device="cuda"`` at budgets 0.3, 0.6 and 1.0 exactly as a machine
without a GPU plans it (the CPU stand-in, ``REMAT_STANDIN=1``, unless ``--native``: fake CUDA
tensors), then moved to the GPU: each plan's step is measured with ``remat.measure_peak``
(max_memory_allocated above the step's start, cuBLAS workspaces counted) and its gradients are
compared with the original model's.  Writes benchmarks/results/cuda.md and cuda.jsonl.

    python benchmarks/cuda.py            # about 5 minutes on an H200
    python benchmarks/cuda.py --quick    # the two vision models at one budget

Without a GPU it says so and exits 0.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, md_table, write_result  # noqa: E402

BUDGETS = (0.3, 0.6, 1.0)
# (spec, batch): the configs are small enough that the whole run stays within a few minutes
WORKLOADS = [
    ("torchvision:resnet50", 32),
    ("torchvision:vit_b_16", 32),
    ("transformers:gpt2:layers=12,width=768,heads=12,seq=512", 8),
    ("transformers:llama:layers=8,width=1024,heads=16,seq=512", 4),
]


def _grad_error(model, gm, inputs, kwargs) -> float:
    """Largest |grad difference| / max |grad| over parameters, one step each from .grad = None."""
    from remat.testing.step import train_step

    ref = train_step(model, inputs, 0, kwargs)[1]
    got = train_step(gm, inputs, 0, kwargs)[1]
    if ref.keys() != got.keys():
        return float("inf")
    worst = 0.0
    for k in ref:
        scale = ref[k].abs().max().item() or 1.0
        worst = max(worst, (got[k] - ref[k]).abs().max().item() / scale)
    return worst


def run_workload(spec: str, batch: int, budgets: tuple[float, ...]) -> list[dict]:
    import remat
    from remat import zoo
    from remat.budget import Budget
    from remat.errors import InfeasibleBudget
    from remat.planner import plan_problem, prepare

    work = zoo.build(spec, batch)
    start = time.perf_counter()
    problem = prepare(work.model, work.inputs, work.kwargs, work.shared_inputs, device="cuda")
    prepare_s = time.perf_counter() - start
    planned = []
    for f in budgets:
        t0 = time.perf_counter()
        try:
            gm, plan = plan_problem(problem, "rotor", Budget(fraction=f))
        except InfeasibleBudget as e:
            planned.append((f, None, None, str(e).split(";")[0], time.perf_counter() - t0))
            continue
        planned.append((f, gm, plan, "", time.perf_counter() - t0))
    device = torch.device("cuda")
    work.model.to(device)  # the generated modules share its parameters and buffers
    inputs = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in work.inputs)
    kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in (work.kwargs or {}).items()}
    rows = []
    for f, gm, plan, why, plan_s in planned:
        row = {"spec": spec, "batch": batch, "fraction": f, "prepare_s": round(prepare_s, 1),
               "plan_s": round(plan_s, 1), "simulated_on": problem.target.fake_device.type}
        if gm is None:
            rows.append({**row, "infeasible": why})
            continue
        gm.to(device)
        measured = remat.measure_peak(gm, inputs, kwargs)
        err = (plan.predicted_peak_bytes - measured) / measured
        rows.append({**row, "budget": plan.budget_bytes, "predicted": plan.predicted_peak_bytes,
                     "measured": measured, "error": err, "fits": measured <= plan.budget_bytes,
                     "regions": len(plan.regions), "grad_error": _grad_error(work.model, gm, inputs, kwargs)})
        del gm
        torch.cuda.empty_cache()
    work.model.to("cpu")
    torch.cuda.empty_cache()
    return rows


def report(rows: list[dict], seconds: float) -> Path:
    from remat.units import fmt_bytes

    table = []
    for r in rows:
        if "infeasible" in r:
            table.append([r["spec"], r["batch"], r["fraction"], "infeasible", "-", "-", "-", "-", "-"])
            continue
        table.append([r["spec"], r["batch"], r["fraction"], fmt_bytes(r["budget"]), fmt_bytes(r["predicted"]),
                      fmt_bytes(r["measured"]), f"{100 * r['error']:+.2f} %", "yes" if r["fits"] else "NO",
                      f"{r['grad_error']:.1e}"])
    errors = [abs(r["error"]) for r in rows if "error" in r]
    summary = (f"{len(errors)} plans measured in {seconds:.0f} s; worst |error| "
               f"{100 * max(errors):.2f} %; over budget: {sum(not r['fits'] for r in rows if 'fits' in r)}"
               if errors else "no plan measured")
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    return write_result("cuda.md", "CUDA plans on a real GPU", [
        f"GPU: {gpu}. Planned with `device=\"cuda\"` on fake tensors (simulated on "
        f"{rows[0]['simulated_on'] if rows else '?'}), measured with `remat.measure_peak` "
        "(max_memory_allocated above the step's start, cuBLAS workspaces counted). error = (predicted - measured) "
        "/ measured; grad error = max |Δgrad| / max |grad| against the original model.",
        md_table(["model", "batch", "budget", "budget bytes", "predicted", "measured", "error", "fits",
                  "grad error"], table),
        summary])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="the vision models at budget 0.6 only")
    parser.add_argument("--native", action="store_true",
                        help="simulate on fake CUDA tensors (this GPU's kernels), not the CPU stand-in")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/cuda.py measures plans on a GPU: none is available here (torch.cuda.is_available() "
              "is False); nothing to do")
        return 0
    if not args.native:
        os.environ["REMAT_STANDIN"] = "1"  # plan as a machine without a GPU does (profiler/standin.py)
    workloads = WORKLOADS[:2] if args.quick else WORKLOADS
    budgets = (0.6,) if args.quick else BUDGETS
    start = time.perf_counter()
    rows: list[dict] = []
    for spec, batch in workloads:
        print(f"{spec} batch {batch}", flush=True)
        rows.extend(run_workload(spec, batch, budgets))
        for r in rows[-len(budgets):]:
            print("  ", {k: v for k, v in r.items() if k not in ("spec", "batch")}, flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cuda.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {report(rows, time.perf_counter() - start)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Model coverage: every torchvision classification model and four HF transformers, end to end.

For each model at a small batch (a bigger one when checkpointing cannot reach the budget there): trace (which frontend), profile, plan at budget 0.5 with rotor, one
training step of the checkpointed module against the original (outputs, gradients, buffers), and the
measured peak against the budget. Each model runs in its own process (a crash or a timeout is a row,
not the end of the sweep). Writes benchmarks/results/zoo.md (and zoo.jsonl as it goes).

    python benchmarks/zoo.py [--models resnet18,transformers:gpt2] [--merge] [--timeout 900] [--batch 8]
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path

from common import RESULTS, md_table, write_result

HF = ["transformers:gpt2", "transformers:bert", "transformers:llama", "transformers:vit"]


def run_one(spec: str, batch: int, budget: float) -> dict:
    """Everything for one model; returns a row dict (never raises)."""
    import copy

    import torch

    import remat
    from remat.errors import InfeasibleBudget
    from remat.step import floating_outputs, loss_of
    from remat.zoo import build

    row: dict = {"model": spec, "ok": False}
    start = time.perf_counter()
    try:
        work = build(spec, batch)
        model = work.model.train()
        twin = copy.deepcopy(model)
        try:
            gm = remat.checkpoint(twin, work.inputs, budget=budget, shared_inputs=work.shared_inputs)
        except InfeasibleBudget as e:
            asked = int(re.search(r"budget of (\d+) bytes", str(e)).group(1))
            row.update(budget=asked, min_bytes=e.min_bytes, bound=e.bound_bytes, min_fraction=e.min_fraction,
                       reason=f"InfeasibleBudget: remat's floor {e.min_bytes / 2**20:.1f} MiB (a fraction of "
                              f"{e.min_fraction:.3f}); no checkpointing goes below {(e.bound_bytes or 0) / 2**20:.1f} MiB"
                              + (" (the budget is under it)" if e.bound_bytes and asked < e.bound_bytes else ""))
            return row
        plan = gm.remat_plan
        row.update(frontend=plan.info["frontend"], stages=len(plan.stages), regions=len(plan.regions),
                   granularity=plan.info["granularity"], budget=plan.budget_bytes,
                   predicted=plan.predicted_peak_bytes, recompute=plan.recompute_ratio)

        def step(m):
            for p in m.parameters():
                p.grad = None
            torch.manual_seed(0)
            out = m(*work.inputs)
            loss_of(out).backward()
            return ([t.detach() for t in floating_outputs(out)],
                    {k: p.grad for k, p in m.named_parameters() if p.grad is not None},
                    {k: b.clone() for k, b in m.named_buffers()})

        ref, got = step(model), step(gm)
        same = (len(ref[0]) == len(got[0]) and all(torch.allclose(a, b, atol=1e-5, rtol=1e-4)
                                                   for a, b in zip(ref[0], got[0])))
        same &= ref[1].keys() == got[1].keys() and all(torch.allclose(ref[1][k], got[1][k], atol=1e-5, rtol=1e-4)
                                                       for k in ref[1])
        same &= ref[2].keys() == got[2].keys() and all(
            torch.allclose(ref[2][k].float(), got[2][k].float(), atol=1e-5, rtol=1e-4) for k in ref[2])
        measured = remat.measure_peak(gm, work.inputs)
        row.update(measured=measured, fits=measured <= plan.budget_bytes, same=bool(same))
        row["ok"] = bool(same) and measured <= plan.budget_bytes
        if not row["ok"]:
            row["reason"] = "gradients/outputs/buffers differ" if not same else "measured peak over budget"
    except Exception as e:  # noqa: BLE001 - a row per failure
        tb = traceback.extract_tb(e.__traceback__)
        where = next((f"{f.filename.split('site-packages/')[-1]}:{f.lineno}" for f in reversed(tb)), "?")
        row["reason"] = f"{type(e).__name__} at {where}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    finally:
        row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def models() -> list[str]:
    import torchvision

    return [f"torchvision:{m}" for m in torchvision.models.list_models(module=torchvision.models)] + HF


def fmt(row: dict) -> list[str]:
    mib = lambda b: f"{b / 2**20:.1f}" if isinstance(b, (int, float)) else "-"  # noqa: E731
    err = (f"{100 * (row['predicted'] - row['measured']) / row['measured']:+.2f}%"
           if "measured" in row and "predicted" in row else "-")
    return [row["model"].replace("torchvision:", ""), str(row.get("batch", "-")), row.get("frontend", "-"),
            str(row.get("stages", "-")),
            mib(row.get("budget")), mib(row.get("predicted")), mib(row.get("measured")), err,
            {True: "yes", False: "NO"}.get(row.get("fits"), "-"), {True: "yes", False: "NO"}.get(row.get("same"), "-"),
            f"{row.get('recompute', 0):.1%}" if "recompute" in row else "-", str(row.get("seconds", "-")),
            "pass" if row["ok"] else row.get("reason", "?")]


def run_isolated(spec: str, batch: int, budget: float, timeout: int) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", spec, "--batch", str(batch), "--budget", str(budget)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        line = next((ln for ln in done.stdout.splitlines() if ln.startswith("ROW ")), None)
        if line:
            return json.loads(line[4:])
        last = (done.stderr.strip().splitlines() or ["?"])[-1][:200]
        return {"model": spec, "batch": batch, "ok": False, "reason": f"process died (exit {done.returncode}): {last}"}
    except subprocess.TimeoutExpired:
        return {"model": spec, "batch": batch, "ok": False, "reason": f"timeout after {timeout} s"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--budget", type=float, default=0.5)
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--big-batch", type=int, default=32,
                    help="retry at this batch when checkpointing cannot reach the budget at --batch")
    ap.add_argument("--merge", action="store_true", help="replace only these models' rows in zoo.jsonl")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # run a single model in this process, print JSON
    args = ap.parse_args(argv)
    if args.one:
        row = run_one(args.one, args.batch, args.budget)
        row["batch"] = args.batch
        print("ROW " + json.dumps(row))
        return 0
    specs = [s if ":" in s else f"torchvision:{s}" for s in args.models.split(",") if s] or models()
    log = RESULTS / "zoo.jsonl"
    RESULTS.mkdir(parents=True, exist_ok=True)
    previous = [json.loads(ln) for ln in log.read_text().splitlines()] if args.merge and log.exists() else []
    rows = []
    for i, spec in enumerate(specs):
        row = run_isolated(spec, args.batch, args.budget, args.timeout)
        if "InfeasibleBudget" in row.get("reason", "") and args.big_batch > args.batch:
            row = run_isolated(spec, args.big_batch, args.budget, args.timeout)
        rows.append(row)
        print(f"[{i + 1}/{len(specs)}] " + " | ".join(fmt(row)), flush=True)
    if previous:
        fresh = {r["model"]: r for r in rows}
        rows = [fresh.pop(r["model"], r) for r in previous] + list(fresh.values())
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    passed = sum(r["ok"] for r in rows)
    infeasible = [r for r in rows if "InfeasibleBudget" in r.get("reason", "")]
    under_bound = sum(1 for r in infeasible if r.get("bound") and r.get("budget", 0) < r["bound"])
    header = ["model", "batch", "frontend", "stages", "budget MiB", "predicted MiB", "measured MiB", "error", "fits",
              "same grads", "recompute", "s", "result"]
    write_result("zoo.md", "Model coverage: plan at budget 0.5, train one step, compare",
                 [f"Rotor at budget {args.budget} (docs/design.md fraction), CPU, batch {args.batch}; where checkpointing "
                  f"cannot reach the budget at that batch (the peak is set by parameters and their gradients or by "
                  f"one op's backward), batch {args.big_batch}. {passed}/{len(rows)} pass (same outputs, gradients "
                  "and buffers as the original model within 1e-5/1e-4, and measured peak <= budget). An "
                  "InfeasibleBudget row states remat's floor at that batch and the bound no checkpointing of the "
                  f"model's code goes below (src/remat/profiler/bound.py); {under_bound} of the "
                  f"{len(infeasible)} budgets are under that bound: no checkpointing plan fits them.",
                  md_table(header, [fmt(r) for r in rows])])
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())

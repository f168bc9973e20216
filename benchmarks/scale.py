"""Planning at LLM scale: wall time and peak RSS of profiling and planning Llama shapes built on the
meta device (no weights allocated), bf16, for a GPU step (``device="cuda"``), plain and FSDP2 per
process.

Each configuration runs in a fresh subprocess (its own peak RSS, a timeout of its own): build the
model on meta, ``remat.profile`` (trace, check, profile), then ``remat.checkpoint`` at the budget
(trace again, profile, solve, verify) or the ``InfeasibleBudget`` it raises.  Targets (issue "Meet
LLM trainers where they work"): a Llama-7B shape (32 x 4096, seq 4096, batch 8) planned in <= 20 s
and <= 2 GiB RSS on 2 CPU cores, an 80 x 8192 model per FSDP process in <= 60 s, InfeasibleBudget as
fast as a plan, time at most linear in depth.

    python benchmarks/scale.py [--quick] [--timeout 900]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

from common import md_table, write_result


@dataclass
class Config:
    layers: int
    width: int
    seq: int
    batch: int = 8
    budget: str = "0.5"
    world_size: int = 1  # > 1: FSDP2, per process

    @property
    def label(self) -> str:
        fsdp = f", FSDP2 x{self.world_size}" if self.world_size > 1 else ""
        return f"{self.layers} x {self.width}, seq {self.seq}, batch {self.batch}, budget {self.budget}{fsdp}"


QUICK = [Config(8, 4096, 4096), Config(16, 4096, 4096), Config(32, 4096, 4096), Config(32, 4096, 4096, budget="40GiB"),
         Config(32, 4096, 4096, budget="0.05")]
FULL = QUICK + [Config(32, 4096, 2048), Config(32, 4096, 8192, batch=1), Config(80, 8192, 4096, batch=1, world_size=8),
                Config(80, 8192, 4096, batch=1, world_size=64), Config(32, 8192, 2048)]


def worker(config: Config) -> dict:
    """One configuration, in this process (the parent runs it in a subprocess)."""
    import resource
    import warnings

    import torch

    import remat
    from remat.zoo import build

    warnings.simplefilter("ignore")
    heads = config.width // 128
    ffn = {4096: 11008, 8192: 28672}.get(config.width, 4 * config.width)
    spec = f"transformers:llama:layers={config.layers},width={config.width},heads={heads},ffn={ffn},seq={config.seq}"
    start = time.perf_counter()
    work = build(spec, config.batch, dtype=torch.bfloat16, meta_model=True)
    built = time.perf_counter()
    prof = remat.profile(work.model, work.inputs, work.kwargs, device="cuda")
    profiled = time.perf_counter()
    sharding = {"world_size": config.world_size, "sharding": "fsdp"} if config.world_size > 1 else {}
    outcome = ""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", remat.RematWarning)
        try:
            gm = remat.checkpoint(work.model, work.inputs, work.kwargs, budget=config.budget, device="cuda",
                                  **sharding)
            plan = gm.remat_plan
            outcome = (f"{len(plan.regions)} regions, predicted {plan.predicted_peak_bytes / 2**30:.2f} GiB of "
                       f"{plan.budget_bytes / 2**30:.2f}")
        except remat.InfeasibleBudget as e:
            outcome = f"InfeasibleBudget (floor {e.min_fraction:.3f})" if e.min_fraction else "InfeasibleBudget"
    if any("whole at the root" in str(w.message) for w in caught):
        outcome += "; warned: every parameter at the FSDP root (torch.export trace: no unit is called)"
    planned = time.perf_counter()
    return {"build_s": built - start, "profile_s": profiled - built, "plan_s": planned - profiled,
            "peak_gib": prof.peak_bytes / 2**30, "rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "outcome": outcome}


def run(config: Config, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--worker", json.dumps(asdict(config))]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"outcome": f"timed out after {timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"outcome": "failed: " + (done.stderr.strip().splitlines() or ["?"])[-1][:120]}
    return json.loads(lines[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the 7B shape at 8/16/32 layers and two budgets")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(Config(**json.loads(args.worker)))))
        return 0
    rows = []
    for config in QUICK if args.quick else FULL:
        r = run(config, args.timeout)
        fmt = lambda key, unit="s": f"{r[key]:.1f} {unit}" if key in r else "-"  # noqa: E731
        rows.append((config.label, fmt("profile_s"), fmt("plan_s"), fmt("rss_gib", "GiB"), fmt("peak_gib", "GiB"),
                     r["outcome"]))
        print(rows[-1], flush=True)
    table = md_table(("Llama shape (bf16, on meta, for cuda)", "profile", "plan", "peak RSS", "unconstrained peak",
                      "outcome"), rows)
    write_result("scale.md", "Planning at LLM scale",
                 ["Each row in a fresh process: `remat.profile` (trace, check, profile), then `remat.checkpoint` "
                  "(trace again, profile, solve, verify). Timings on 2 CPU cores.", table])
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

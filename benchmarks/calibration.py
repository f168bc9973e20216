"""What measuring kernel scratch costs: profiling with a cold and a warm measurement cache.

For each model (real inputs on this machine's CPU): the number of distinct op signatures measured,
the time of the first profile (cold cache: every signature run once on real tensors) against the
second (warm cache) and against a profile with the rules only (calibrate=False), the most real
memory one measurement took, and predicted vs measured peak for both scratch sources.
Writes benchmarks/results/calibration.md.

    python benchmarks/calibration.py [--models torchvision:resnet50,transformers:gpt2] [--batch 8]
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time

import remat
from remat.profiled import trace_and_profile
from remat.units import fmt_bytes
from remat.zoo import build

from common import md_table, write_result

MODELS = ["torchvision:resnet50", "transformers:gpt2", "torchvision:vit_b_16"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args(argv)
    os.environ["REMAT_CACHE_DIR"] = tempfile.mkdtemp(prefix="remat-calibration-bench-")  # a cold cache
    rows = []
    for spec in args.models.split(","):
        work = build(spec, args.batch)
        timings = {}
        for label, calibrate in (("cold", True), ("warm", True), ("rules", False)):
            start = time.perf_counter()
            done = trace_and_profile(work.model, work.inputs, work.kwargs, calibrate)
            timings[label] = (time.perf_counter() - start, done)
        measured = remat.measure_peak(work.model, work.inputs, work.kwargs)
        cold, warm, rules = (timings[k][1] for k in ("cold", "warm", "rules"))
        err = lambda p: f"{100.0 * (p.profile.peak_bytes - measured) / measured:+.3f}%"  # noqa: E731
        rows.append([spec.split(":")[1], args.batch, cold.scratch.measured, f"{timings['cold'][0]:.1f}",
                     f"{cold.scratch.seconds:.1f}", f"{timings['warm'][0]:.1f}", f"{timings['rules'][0]:.1f}",
                     fmt_bytes(cold.scratch.largest_bytes), fmt_bytes(measured), err(warm), err(rules)])
        print(" | ".join(map(str, rows[-1])), flush=True)
        del work, timings, cold, warm, rules
        gc.collect()
    header = ["model", "batch", "signatures measured", "profile s (cold cache)", "of which measuring s",
              "profile s (warm cache)", "profile s (rules only)", "largest measurement", "measured peak",
              "error, measured scratch", "error, rules"]
    write_result("calibration.md", "What measuring kernel scratch costs", [
        "Each distinct op signature of the training step is run once on real CPU tensors of its shape, "
        "strides and dtype, and its scratch read from the allocator's events (src/remat/profiler/calibrate.py); "
        "the result is cached on disk. Cold: a fresh cache; warm: the same profile again; rules: "
        "`calibrate=False`. Times include tracing and the trace check. 'largest measurement' is the most real "
        "memory one op's measurement took (its inputs, outputs and scratch).",
        md_table(header, rows)])
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Predicted vs measured peak memory of one training step (the seed's estimated-vs-real table).

For each model at batch 4 on this machine's CPU: remat's predicted peak (fake tensors), the peak
measured from the CPU allocator's events, the error, saved activation bytes, parameter bytes,
forward/backward FLOPs and the profiling time. Also gpt2-medium profiled at a big batch on meta
only, and resnet50 at batch 4000 on meta timed against FlopCounterMode's fwd+bwd in the same run.
Writes benchmarks/results/memory.md.

    python benchmarks/memory.py [--batch 4] [--models torchvision:resnet18,...]
"""
from __future__ import annotations

import argparse
import gc
import sys

import torch
from torch.utils.flop_counter import FlopCounterMode

import remat
from remat.units import fmt_bytes, fmt_flops
from remat.zoo import build

from common import max_rss_bytes, md_table, median_time, write_result

MODELS = [f"torchvision:{m}" for m in (
    "vgg11", "resnet18", "densenet121", "mobilenet_v3_small", "resnext50_32x4d", "wide_resnet50_2",
    "regnet_x_16gf", "mnasnet0_5", "convnext_tiny", "efficientnet_b0", "vit_b_16", "resnet50")] + [
    "transformers:gpt2"]
TARGETS = {"vgg11", "resnet18", "resnet50", "densenet121", "mobilenet_v3_small", "efficientnet_b0",
           "convnext_tiny", "vit_b_16", "gpt2"}  # must be within 1 %


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--big-batch", type=int, default=64, help="batch of the meta-only gpt2-medium profile")
    args = ap.parse_args(argv)
    rows, failures = [], []
    for spec in args.models.split(","):
        work = build(spec, args.batch)
        prof = remat.profile(work.model, work.inputs)
        measured = remat.measure_peak(work.model, work.inputs)
        err = 100.0 * (prof.peak_bytes - measured) / measured
        short = spec.split(":")[1]
        ok = abs(err) <= 1.0
        if short in TARGETS and not ok:
            failures.append(f"{short}: error {err:+.2f} %")
        rows.append([short, prof.frontend, fmt_bytes(prof.peak_bytes), fmt_bytes(measured), f"{err:+.3f}%",
                     fmt_bytes(prof.saved_bytes), fmt_bytes(prof.param_bytes), fmt_flops(prof.fwd_flops),
                     fmt_flops(prof.bwd_flops), f"{prof.profile_seconds:.2f}"])
        print(" | ".join(map(str, rows[-1])), flush=True)
        del work, prof
        gc.collect()

    big = build("transformers:gpt2-medium", args.big_batch, meta_inputs=True)
    big_prof = remat.profile(big.model, big.inputs)
    big_row = [f"gpt2-medium (24 layers, width 1024, seq 1024), batch {args.big_batch}, meta only",
               fmt_bytes(big_prof.peak_bytes), fmt_bytes(big_prof.saved_bytes), fmt_bytes(big_prof.param_bytes),
               fmt_flops(big_prof.fwd_flops), fmt_flops(big_prof.bwd_flops), f"{big_prof.profile_seconds:.2f}"]
    del big, big_prof
    gc.collect()

    r50 = build("torchvision:resnet50", 4000, meta_inputs=True)
    t_profile = median_time(lambda: remat.profile(r50.model, r50.inputs), repeat=3)
    with torch.device("meta"):
        import torchvision
        meta_model = torchvision.models.resnet50()

    def flop_counter():
        with FlopCounterMode(display=False):
            meta_model(r50.inputs[0]).sum().backward()

    t_fcm = median_time(flop_counter, repeat=3)
    ratio = t_profile / t_fcm
    if ratio > 3.0:
        failures.append(f"resnet50@4000 profile/FlopCounterMode time ratio {ratio:.2f} > 3")

    header = ["model", "frontend", "predicted peak", "measured peak", "error", "saved activations",
              "parameters", "fwd FLOPs", "bwd FLOPs", "profile s"]
    sections = [
        f"Batch {args.batch}, CPU. Peak as docs/design.md defines it: resident bytes (parameters, buffers, inputs) plus "
        "the highest allocation above them during `out = model(x); loss = sum(out.float().sum()); "
        "loss.backward()`. Measured from the CPU allocator's own events (torch.profiler, profile_memory=True) "
        "after one warm-up step; predicted on fake tensors by `remat.profile` (no real memory). "
        f"Peak resident memory of this whole run: {fmt_bytes(max_rss_bytes())}.",
        md_table(header, rows),
        "## Big batch on meta only\n\n" + md_table(
            ["model", "predicted peak", "saved activations", "parameters", "fwd FLOPs", "bwd FLOPs", "profile s"],
            [big_row]),
        f"## Profiling speed\n\nresnet50 at batch 4000 on meta: `remat.profile` {t_profile:.2f} s, FlopCounterMode "
        f"fwd+bwd on the meta model {t_fcm:.2f} s (medians of 3, same run): ratio {ratio:.2f} (target <= 3).",
        "## Where the error comes from\n\nThe simulated allocator follows every storage of the step, so the "
        "remaining error is memory the real kernels allocate that no aten output shows. remat models the CPU "
        "cases that matter (src/remat/profiler/rules/): oneDNN convolution reorders and blocked-to-dense "
        "copies, BLAS copies of operands it cannot stride through, BatchNorm/LayerNorm backward temporaries. "
        "A few small oneDNN scratch buffers (at most a weight-sized buffer per convolution backward) are not "
        "modeled; they explain the last hundredths of a percent.",
    ]
    if failures:
        sections.append("Failures: " + "; ".join(failures))
    write_result("memory.md", "Predicted vs measured peak memory", sections)
    print("\n".join(sections[2:4]))
    for f in failures:
        print("FAIL", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

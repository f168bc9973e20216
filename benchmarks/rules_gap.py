"""Where the memory rules fall short of the measured kernels, op by op.

For each opfuzz seed, profiles the configuration with measured scratch (profiler/calibrate.py) and,
next to every measured op, asks the rules what they would have said.  Prints, per aten op, how often
and by how much the measured kernel memory (scratch + extra output bytes) exceeds the rules' scratch,
and how often the real output strides differ from the fake ones (a layout the rules do not know,
which changes what later ops copy).  A diagnostic for writing rules, not a benchmark result.

    python benchmarks/rules_gap.py --seeds 0:300 [--families conv] [--threads 2] [--top 40]
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

import torch

import remat
import remat.profiled as problem
from opfuzz import build, family_of, real_step
from remat.profiler.calibrate import Calibration, calibration_for
from remat.profiler.dispatch import KernelMemory, RuleScratch

LOG: list[dict] = []


class Compare(Calibration):
    """Measured kernel memory, with the rules' answer for the same call logged beside it."""

    def kernel(self, func, args, kwargs, out, rules, ctx) -> KernelMemory:
        got = super().kernel(func, args, kwargs, out, rules, ctx)
        ruled = RuleScratch().kernel(func, args, kwargs, out, rules, ctx)
        outs = out if isinstance(out, (tuple, list)) else [out]
        fake = [tuple(t.stride()) if isinstance(t, torch.Tensor) else None for t in outs]
        relaid = got.strides is not None and any(
            a is not None and b is not None and tuple(a) != tuple(b) for a, b in zip(got.strides, fake))
        LOG.append({"op": str(func), "measured": got.scratch + got.extra_out, "rule": ruled.scratch,
                    "relaid": relaid, "sig": _short(args)})
        return got


def _short(args) -> str:
    parts = []
    for a in args:
        if isinstance(a, torch.Tensor):
            parts.append(f"{str(a.dtype)[6:]}{list(a.shape)}{'' if a.is_contiguous() else 's' + str(list(a.stride()))}")
        elif isinstance(a, (list, tuple)) and len(a) <= 4 and not any(isinstance(x, torch.Tensor) for x in a):
            parts.append(str(list(a)))
        elif isinstance(a, (int, float, bool)) or a is None:
            parts.append(str(a))
    return " ".join(parts)[:200]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0:200")
    ap.add_argument("--families", default="all")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--dump", default=None, help="write every logged op call as JSON lines here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lo, hi = map(int, args.seeds.split(":"))
    fams = None if args.families == "all" else set(args.families.split(","))

    def compare_for(target, tensors, enabled=None):
        base = calibration_for(target, tensors, True)
        return Compare(base.target, base.limit_bytes)

    problem.calibration_for = compare_for
    for seed in range(lo, hi):
        if fams and family_of(seed) not in fams:
            continue
        case = build(seed)
        try:
            real_step(case)
        except Exception:  # noqa: BLE001
            continue
        start = len(LOG)
        try:
            remat.profile(case.model, case.inputs)
        except Exception as e:  # noqa: BLE001
            print(f"seed {seed}: {type(e).__name__}: {e}", file=sys.stderr)
        for rec in LOG[start:]:
            rec.update(seed=seed, family=case.family)
    by: dict[str, list[dict]] = defaultdict(list)
    for rec in LOG:
        by[rec["op"]].append(rec)
    rows = []
    for op, recs in by.items():
        short = [r for r in recs if r["measured"] > r["rule"]]
        deficit = max((r["measured"] - r["rule"] for r in short), default=0)
        rows.append((deficit, op, len(recs), len(short), sum(r["relaid"] for r in recs),
                     max(short, key=lambda r: r["measured"] - r["rule"]) if short else None))
    for deficit, op, n, nshort, nrelaid, worst in sorted(rows, reverse=True)[: args.top]:
        print(f"{op:50s} calls {n:5d} short {nshort:5d} relaid {nrelaid:4d} worst deficit {deficit:>12d}"
              + (f"  (seed {worst['seed']} measured {worst['measured']} rule {worst['rule']}: {worst['sig']})" if worst else ""))
    if args.dump:
        with open(args.dump, "w") as f:
            for rec in LOG:
                f.write(json.dumps(rec) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

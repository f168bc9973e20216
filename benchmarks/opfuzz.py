"""Op-level fuzz: remat's predicted step peak against the measured one on random single ops and blocks.

Each configuration (benchmarks/opfuzz_cases.py: conv, pool, interp, norm, embedding, rnn, attention,
reduction, matmul, pointwise, block, autocast: mixed-precision chains) is a small module with example inputs drawn from
``random.Random(seed)``. It first runs one real training step (``out = model(*inputs)``, loss = sum
of ``.float().sum()`` over floating outputs, ``loss.backward()``); if torch itself raises, the
configuration is a ``skip``. Then ``remat.profile(...).peak_bytes`` (fake tensors) is compared with
``remat.measure_peak(...)`` (CPU allocator events) of the traced step, the module every plan generates
and is verified against; an exception from remat is an ``error``.  The model's own (eager) step is
measured too: Python code that keeps intermediates in locals until a function returns (MHA with
``need_weights``) can peak above its trace, which frees each value after its last use.
``--seed K`` draws seeds K*10^6 + i; a seed alone fixes the configuration (its family included).
Writes benchmarks/results/opfuzz.jsonl (one line per configuration) and opfuzz.md.

    python benchmarks/opfuzz.py --n 2000 [--seed 0] [--families conv,norm] [--only-seed S]
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import queue
import statistics
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

import remat
from common import md_table, write_result
from remat.profiled import trace_and_profile
from opfuzz_cases import BUILDERS, SIDE_FAMILIES, WEIGHTS, Case

FAMILIES = list(BUILDERS)
_DRAWN = [f for f in FAMILIES if f not in SIDE_FAMILIES]  # drawn from the seed's own stream
SCRATCH = "measured"  # --scratch: kernel scratch measured on this machine (the default), or the rules only


def family_of(seed: int) -> str:
    """The family a seed draws, independent of --families (so a seed always means one configuration).
    A side family (autocast) takes its share of seeds from a stream of its own; the rest draw as
    they did before it existed."""
    for family, share in SIDE_FAMILIES.items():
        if random.Random(f"{family}:{seed}").random() < share:
            return family
    return random.Random(seed).choices(_DRAWN, [WEIGHTS.get(f, 1) for f in _DRAWN])[0]


def build(seed: int) -> Case:
    rng = random.Random(seed)
    rng.random()  # the draw family_of used
    torch.manual_seed(seed)
    return BUILDERS[family_of(seed)](rng)


def _floating(out: object) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _floating(o)]
    return []


def real_step(case: Case) -> None:
    """One real training step, as remat defines it; raises where torch cannot run the configuration."""
    parts = [t.float().sum() for t in _floating(case.model(*case.inputs)) if t.requires_grad]
    if parts:
        sum(parts[1:], parts[0]).backward()
    clear_grads(case)


def clear_grads(case: Case) -> None:
    for t in [*case.model.parameters(), *case.inputs]:
        if isinstance(t, torch.Tensor):
            t.grad = None


def _exc(e: BaseException) -> str:
    frame = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    where = f" [{Path(frame.filename).name}:{frame.lineno}]" if frame else ""
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}{where}"


def new_record(seed: int, family: str, desc: str) -> dict:
    return {"seed": seed, "family": family, "desc": desc, "status": "ok", "predicted": None, "measured": None,
            "measured_eager": None, "error_pct": None, "abs_error": None, "exception": None, "warnings": [], "seconds": None}


def run_one(seed: int, stage: Callable[[str, dict], None] = lambda s, r: None) -> dict:
    """Build, try for real, predict, measure: one JSON-able record. ``stage`` hears each step start
    (so a parent process can tell where a worker that crashed was)."""
    start = time.perf_counter()
    case = build(seed)
    rec = new_record(seed, case.family, case.desc)
    try:
        stage("real step", rec)
        real_step(case)
    except Exception as e:  # noqa: BLE001 - torch cannot run it on this CPU
        rec.update(status="skip", exception=_exc(e))
    if rec["status"] == "ok":
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                stage("profile", rec)
                # remat.profile's prediction, with the module that runs the traced step (what every
                # plan generates and is verified against)
                profiled = trace_and_profile(case.model, case.inputs, {}, calibrate=SCRATCH == "measured")
                rec["predicted"] = int(profiled.profile.peak_bytes)
            rec["warnings"] = sorted({f"{w.category.__name__}: {str(w.message)[:200]}" for w in caught
                                      if issubclass(w.category, remat.RematWarning)})
            stage("measure_peak", rec)
            rec["measured"] = int(remat.measure_peak(profiled.baseline, case.inputs))
            clear_grads(case)  # measure_peak leaves .grad on inputs; profile would count it next time
            rec["measured_eager"] = int(remat.measure_peak(case.model, case.inputs))
            clear_grads(case)
        except Exception as e:  # noqa: BLE001 - a finding about remat
            rec.update(status="error", exception=("measure_peak: " if rec["predicted"] is not None else "profile: ") + _exc(e))
    if rec["status"] == "ok":
        rec["abs_error"] = rec["predicted"] - rec["measured"]
        rec["error_pct"] = 100.0 * rec["abs_error"] / rec["measured"]
    rec["seconds"] = round(time.perf_counter() - start, 3)
    return rec


def worker() -> None:
    """Child process: seeds in on stdin, stage lines and records out on stdout."""
    def stage(name: str, rec: dict) -> None:
        print(json.dumps({"stage": name, "family": rec["family"], "desc": rec["desc"]}), flush=True)

    for line in sys.stdin:
        print(json.dumps(run_one(int(line), stage)), flush=True)


def _json(line: str) -> dict:
    try:
        msg = json.loads(line)
    except ValueError:
        return {}
    return msg if isinstance(msg, dict) else {}


def run_isolated(seeds: Iterator[int], threads: int, timeout: float = 600.0) -> Iterator[dict]:
    """run_one for each seed in a worker process, restarted when torch crashes it (a segfault in a
    kernel) or a configuration hangs: such a configuration becomes a skip (crash in the real step)
    or an error (crash inside remat.profile), with the signal."""
    cmd = [sys.executable, __file__, "--worker", "--threads", str(threads), "--scratch", SCRATCH]
    proc, lines = None, queue.Queue()
    for seed in seeds:
        if proc is None:
            proc, lines = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True), queue.Queue()
            threading.Thread(target=lambda out, q: [q.put(x) for x in out] + [q.put("")],
                             args=(proc.stdout, lines), daemon=True).start()
        proc.stdin.write(f"{seed}\n")
        proc.stdin.flush()
        last: dict = {"stage": "build", "family": family_of(seed), "desc": ""}
        start = time.perf_counter()
        while True:
            try:
                line = lines.get(timeout=max(1.0, timeout - (time.perf_counter() - start)))
            except queue.Empty:
                line = None
            msg = _json(line or "")
            if "status" in msg:
                yield msg
                break
            if "stage" in msg:
                last = msg
            if line:  # a stage, or stray output from a library
                continue
            if proc.poll() is None:
                proc.kill()
            code = proc.wait()
            why = "killed after a timeout" if line is None else \
                f"the process died ({f'signal {-code}' if code < 0 else f'exit code {code}'})"
            rec = new_record(seed, last["family"], last["desc"])
            rec.update(status="skip" if last["stage"] in ("build", "real step") else "error",
                       exception=f"{last['stage']}: {why}", seconds=round(time.perf_counter() - start, 3))
            yield rec
            proc = None
            break
    if proc is not None:
        proc.stdin.close()
        proc.wait()


def fmt_b(n: float) -> str:
    sign, n = ("-" if n < 0 else ""), abs(n)
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{n:.0f} B"


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def family_table(recs: list[dict]) -> str:
    by: dict[str, list[dict]] = defaultdict(list)
    for r in recs:
        by[r["family"]].append(r)
    rows = []
    for fam in [f for f in FAMILIES if f in by] + ["all"]:
        rs = recs if fam == "all" else by[fam]
        ok = [r for r in rs if r["status"] == "ok"]
        under = [r for r in ok if r["abs_error"] < 0]
        worst = min(under, key=lambda r: r["error_pct"]) if under else None
        worst_b = min(under, key=lambda r: r["abs_error"]) if under else None
        over = max((r["error_pct"] for r in ok), default=0.0)
        rows.append([fam, len(ok), sum(r["status"] == "error" for r in rs), sum(r["status"] == "skip" for r in rs),
                     len(under), f"{worst['error_pct']:+.2f}% ({fmt_b(worst['abs_error'])}, seed {worst['seed']})" if worst else "-",
                     f"{fmt_b(worst_b['abs_error'])} ({worst_b['error_pct']:+.2f}%, seed {worst_b['seed']})" if worst_b else "-",
                     f"{over:+.2f}%" if ok else "-",
                     f"{statistics.median(abs(r['error_pct']) for r in ok):.3f}%" if ok else "-"])
    return md_table(["family", "ok", "error", "skip", "under-predicted", "worst under %", "worst under bytes",
                     "worst over %", "median abs error"], rows)


def op_of(rec: dict) -> str:
    """The op (or block kind) a description starts with, for the breakdown table."""
    desc = rec["desc"]
    if desc.startswith("F.interpolate"):
        return "interpolate " + desc.split("mode=")[1].split(",")[0]
    if rec["family"] in ("block", "pointwise"):
        return rec["family"] if desc.startswith("pre=") else desc.split(":")[0]
    return desc.split("(")[0]


def op_table(recs: list[dict]) -> str:
    """Error by op and dtype: where the under-predictions concentrate."""
    by: dict[tuple, list[dict]] = defaultdict(list)
    for r in recs:
        if r["status"] == "ok":
            by[(FAMILIES.index(r["family"]), op_of(r), "bf16" if "bfloat16" in r["desc"] else "fp32")].append(r)
    rows = []
    for (fam, op, dt), rs in sorted(by.items()):
        errs = [r["error_pct"] for r in rs]
        worst = min(rs, key=lambda r: r["error_pct"])
        rows.append([FAMILIES[fam], op, dt, len(rs), sum(e < 0 for e in errs), sum(e < -10 for e in errs),
                     f"{statistics.median(errs):+.2f}%", f"{worst['error_pct']:+.2f}% (seed {worst['seed']})",
                     fmt_b(min(r["abs_error"] for r in rs))])
    return md_table(["family", "op", "dtype", "ok", "under", "under > 10%", "median error", "worst error",
                     "min(predicted - measured)"], rows)


def margins(recs: list[dict]) -> str:
    """Overall worst and 99th-percentile under-prediction, relative and absolute (0 where over)."""
    ok = [r for r in recs if r["status"] == "ok"]
    if not ok:
        return "No successful configurations."
    rel = [max(0.0, -r["error_pct"]) for r in ok]
    ab = [max(0, -r["abs_error"]) for r in ok]
    under = [r for r in ok if r["abs_error"] < 0]
    worst_rel = min(ok, key=lambda r: r["error_pct"])
    worst_abs = min(ok, key=lambda r: r["abs_error"])
    lines = [f"Over {len(ok)} ok configurations, {len(under)} under-predicted (predicted < measured).",
             f"Worst under-prediction, relative: {max(rel):.3f}% (seed {worst_rel['seed']}, {fmt_b(worst_rel['abs_error'])}).",
             f"Worst under-prediction, absolute: {fmt_b(max(ab))} = {max(ab)} B (seed {worst_abs['seed']}, "
             f"{worst_abs['error_pct']:+.3f}%).",
             f"99th percentile of under-prediction (over all ok configurations, over-predictions counted as 0): "
             f"{percentile(rel, 99):.3f}% relative, {fmt_b(percentile(ab, 99))} = {percentile(ab, 99)} B absolute."]
    if under:
        lines.append(f"99th percentile among the under-predicted only: {percentile([-r['error_pct'] for r in under], 99):.3f}% "
                     f"relative, {fmt_b(percentile([-r['abs_error'] for r in under], 99))} absolute.")
    return "\n".join(f"- {x}" for x in lines)


def _eager_above(r: dict) -> float:
    """How far the eager step peaks above the traced one, in percent."""
    return 100 * (r["measured_eager"] / r["measured"] - 1)


def eager_table(ok: list[dict]) -> str:
    """Where the model run eagerly peaks above its traced step (Python locals held to a function's
    return): not a prediction error of plans, which run the trace, but what remat.profile of the
    model can miss."""
    above = sorted((r for r in ok if r.get("measured_eager") is not None and r["measured_eager"] > r["measured"]),
                   key=_eager_above, reverse=True)
    head = (f"{len(above)} of {len(ok)} configurations peak higher run eagerly than traced"
            + (f"; the largest: +{_eager_above(above[0]):.2f}% (seed {above[0]['seed']})." if above else "."))
    if not above:
        return head
    return head + "\n\n" + md_table(["seed", "family", "traced", "eager", "eager above", "configuration"],
                                     [[r["seed"], r["family"], r["measured"], r["measured_eager"],
                                       f"+{_eager_above(r):.2f}%", r["desc"]] for r in above[:10]])


def report(recs: list[dict], args: argparse.Namespace, seconds: float) -> list[str]:
    ok = [r for r in recs if r["status"] == "ok"]
    worst = sorted((r for r in ok if r["abs_error"] < 0), key=lambda r: r["error_pct"])[:20]
    errors = [r for r in recs if r["status"] == "error"]
    skips: dict[str, int] = defaultdict(int)
    for r in recs:
        if r["status"] == "skip":
            skips[r["exception"].split(" [")[0][:140]] += 1
    warned: dict[str, int] = defaultdict(int)
    for r in ok:
        for w in r["warnings"]:
            warned[w] += 1
    first = args.seed * 1_000_000
    sections = [
        f"{len(recs)} random configurations (seeds from {first}, families {args.families}) in {seconds:.0f} s, "
        f"{torch.get_num_threads()} torch thread(s), kernel scratch {'measured on this machine' if SCRATCH == 'measured' else 'from the rules only (calibrate=False)'}. "
        "Per configuration: one real step (a skip if torch raises or "
        "crashes), then `remat.profile(model, inputs).peak_bytes` with no `.grad` on inputs or parameters, then "
        "`remat.measure_peak` of the traced step (the module plans generate; the eager model's own peak is in the "
        "last section). Error = (predicted - measured) / measured; under-prediction "
        "(predicted < measured) is the dangerous direction. `python benchmarks/opfuzz.py --only-seed S` reruns one.",
        "## By family\n\n" + family_table(recs),
        "## Margins\n\n" + margins(recs),
        "## By op and dtype\n\n" + op_table(recs),
        "## 20 worst under-predictions\n\n" + (md_table(
            ["seed", "family", "error", "bytes", "predicted", "measured", "configuration"],
            [[r["seed"], r["family"], f"{r['error_pct']:+.2f}%", fmt_b(r["abs_error"]), r["predicted"], r["measured"],
              r["desc"]] for r in worst]) if worst else "None."),
        "## remat errors\n\n" + ("\n".join(f"- seed {r['seed']} ({r['family']}): {r['exception']} -- {r['desc']}"
                                          for r in errors) if errors else "None."),
        "## Skipped (torch cannot run them on this CPU)\n\n" + ("\n".join(f"- {n} x {m}" for m, n in sorted(
            skips.items(), key=lambda kv: -kv[1])) if skips else "None."),
    ]
    sections.append("## The eager model against its trace\n\n" + eager_table(ok))
    if warned:
        sections.append("## remat warnings\n\nConfigurations whose profile warned (remat warns once per op per process, "
                        "so these count first sightings per worker process):\n\n" + "\n".join(f"- {n} x {w}" for w, n in sorted(warned.items(), key=lambda kv: -kv[1])))
    return sections


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--families", default="all", help=f"comma-separated subset of {','.join(FAMILIES)}")
    ap.add_argument("--only-seed", type=int, default=None, help="rerun one configuration and print its details")
    ap.add_argument("--out", default=None, help="path stem of the .jsonl and .md results "
                    "(default benchmarks/results/opfuzz, or opfuzz_rules with --scratch rules)")
    ap.add_argument("--scratch", choices=["measured", "rules"], default="measured",
                    help="kernel scratch measured on this machine (remat's default for real CPU inputs) or bounded "
                         "by the rules alone (what inputs on meta or another device get)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steady on a shared machine)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    global SCRATCH
    SCRATCH = args.scratch
    # the default path is beside this script, wherever it is run from
    args.out = args.out or str(Path(__file__).resolve().parent / "results" / ("opfuzz" + ("_rules" if args.scratch == "rules" else "")))
    torch.set_num_threads(args.threads)
    if args.worker:
        worker()
        return 0
    if args.only_seed is not None:
        print(json.dumps(run_one(args.only_seed), indent=1))
        return 0
    fams = FAMILIES if args.families == "all" else args.families.split(",")
    unknown = set(fams) - set(FAMILIES)
    if unknown:
        ap.error(f"unknown families {sorted(unknown)}; choose from {FAMILIES}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    recs: list[dict] = []
    start, first = time.perf_counter(), args.seed * 1_000_000
    seeds = (s for s in itertools.count(first) if family_of(s) in fams)
    with open(out.with_suffix(".jsonl"), "w") as jsonl:
        for rec in run_isolated(itertools.islice(seeds, args.n), args.threads):
            recs.append(rec)
            jsonl.write(json.dumps(rec) + "\n")
            jsonl.flush()
            if len(recs) % 50 == 0:
                ok = [r for r in recs if r["status"] == "ok"]
                worst = min((r["error_pct"] for r in ok), default=0.0)
                print(f"{len(recs)}/{args.n} {time.perf_counter() - start:.0f}s ok {len(ok)} "
                      f"error {sum(r['status'] == 'error' for r in recs)} skip {sum(r['status'] == 'skip' for r in recs)} "
                      f"worst {worst:+.2f}%", flush=True)
    seconds = time.perf_counter() - start
    sections = report(recs, args, seconds)
    if out.parent.resolve() == (Path(__file__).resolve().parent / "results"):
        write_result(out.name + ".md", "Op-level fuzz: predicted vs measured step peak", sections)
    else:
        out.with_suffix(".md").write_text("# Op-level fuzz: predicted vs measured step peak\n\n" + "\n\n".join(sections) + "\n")
    print("\n\n".join(sections[:3]))
    print(f"elapsed {seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The ``remat`` command: flops | profile | plan | sweep, on models named by a zoo spec."""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from . import zoo

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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, ImportError, TypeError) as e:
        print(f"remat: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

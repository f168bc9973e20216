"""The ``remat`` command: flops | profile | plan | sweep, on models named by a zoo spec.

This module is the parser and ``main``; the commands themselves are in ``commands.py``.  Only
argparse and torch-free modules are imported at the top, so ``remat --help`` answers at once; each
command imports what it needs.  Arguments are checked before any model is built: a bad budget,
batch or spec costs no tracing.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from collections.abc import Sequence
from typing import NoReturn

from .. import progress
from . import commands
from ..budget import Budget, parse_budget
from .commands import PROFILE_COLUMNS
from ..solvers.registry import DEFAULT_SLOTS, SOLVERS
from ..specs import DEFAULT_SPEC, parse_spec

__all__ = ["main", "build_parser", "PROFILE_COLUMNS"]


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


_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16", "half": "float16"}


def _dtype(text: str) -> str:
    """A dtype name (resolved to torch's once torch is imported: this module does not import it)."""
    key = text.strip().lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}; choose float32, bfloat16 (bf16) or float16 (fp16)")
    return _DTYPES[key]


def _version() -> str:
    """remat's version and the torch it would run with, without importing torch."""
    from importlib.metadata import PackageNotFoundError, version

    from .. import __version__

    try:
        torch_version = version("torch")
    except PackageNotFoundError:  # pragma: no cover - remat needs torch installed
        torch_version = "not installed"
    return f"remat {__version__} (torch {torch_version})"


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
                        "kernels and caching allocator) on fake tensors, no GPU needed, and builds a transformers "
                        "model on the meta device (default: where the model is built, the CPU)")
    p.add_argument("--dtype", type=_dtype, default=None, metavar="T",
                   help="the model's parameters and floating inputs: float32, bfloat16 (bf16) or float16 (fp16)")
    p.add_argument("--seq", type=_positive_int, default=None, metavar="S",
                   help="sequence length of a transformers model (the spec's seq= option)")
    p.add_argument("--meta", action="store_true",
                   help="build a transformers model on the meta device: no memory for its weights (a 7B-70B "
                        "shape plans on a laptop); implied by --device cuda")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="remat", description=__doc__.split("\n", 1)[0],
                     epilog="remat COMMAND --help shows a command's options; docs/design.md says how remat works")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = [_common()]

    p = sub.add_parser("flops", parents=common, help="forward/backward FLOPs and MACs of a training step, top ops",
                       description="Count the FLOPs of one training step on fake tensors (no memory needed).")
    _add_model_args(p)
    p.add_argument("--top", type=_positive_int, default=10, metavar="K",
                   help="list the K ops with the most FLOPs, forward and backward together (default 10)")
    p.set_defaults(run=commands.cmd_flops)

    p = sub.add_parser("profile", parents=common, help="per-node memory and FLOPs, predicted peak of a training step",
                       description="Profile one training step on fake tensors: per-node memory and FLOPs and the "
                                   "predicted peak; the columns are explained under the table.")
    _add_model_args(p)
    p.add_argument("--measure", action="store_true", help="also run one real step and show the measured peak")
    p.add_argument("--top", type=_positive_int, default=None, metavar="K",
                   help="show only the K nodes that keep the most memory after their forward (fwd_in + fwd_tmp + "
                        "fwd_out), largest first (default: every node, in graph order)")
    p.set_defaults(run=commands.cmd_profile)

    p = sub.add_parser("plan", parents=common, help="checkpoint a model under a budget and show the plan",
                       description="Plan where to checkpoint so one training step fits the budget; show the plan, "
                                   "and optionally measure it, write its code, save it or draw its memory.")
    _add_model_args(p)
    p.add_argument("--budget", default=None, type=_budget,
                   help="bytes, a size ('2GiB', '800MB'), a fraction of what checkpointing can save ('50%%', "
                        "'0.5': fixed + f x (unconstrained - fixed)), or 'min' (the smallest that fits); default: "
                        "50%% for a solver that plans under a budget, or the smallest budget that fits when 50%% is "
                        "below it (the plan says which); none for the others")
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
    p.set_defaults(run=commands.cmd_plan)

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
    p.set_defaults(run=commands.cmd_sweep)
    return parser


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """remat's own warnings as one line each (``remat: warning: ...``), not Python's file, line and
    source excerpt: they speak to the command's user, and an error stays the last line."""
    from ..errors import RematWarning

    if issubclass(category, RematWarning):
        text = " ".join(str(message).split()).removeprefix("remat: ")
        text = f"remat: warning: {text}\n"
    else:
        text = warnings.formatwarning(message, category, filename, lineno, line)
    (file or sys.stderr).write(text)


def _configure(args: argparse.Namespace) -> None:
    """Progress on a terminal unless -q; -v: remat's DEBUG log on stderr (remat's logger only);
    remat's warnings one line each (``main`` puts Python's display back when it returns)."""
    warnings.showwarning = _show_warning
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
    from ..errors import RematError

    shown = warnings.showwarning
    try:
        _configure(args)
        return args.run(args)
    except RematError as e:
        print(f"remat: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except (ValueError, ImportError, TypeError) as e:
        print(f"remat: error: {e}", file=sys.stderr)
        return 2
    finally:
        progress.disable()
        warnings.showwarning = shown


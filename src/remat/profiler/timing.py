"""Predicted op times: what recomputing an op costs, for the solvers.

FLOPs are a poor proxy for time: recomputing a norm or an activation costs memory traffic, not
arithmetic.  An op's time is measured on the planning machine when its memory is (calibrate.py
times it, the best of a few runs outside the profiler), else estimated with a roofline: the larger of its
FLOPs at the machine's matmul rate and the bytes it reads and writes at the machine's copy
bandwidth, plus a per-op overhead.  The three machine numbers are measured once per (device type,
torch version, threads) and cached next to the kernel measurements.
"""
from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..cache import cache_dir

__all__ = ["Machine", "best_of", "machine", "moves_no_data", "op_seconds", "roofline_seconds", "tensor_bytes", "on_grid",
           "GRID_STEPS"]

# Measured times are noisy (a best of five runs on a shared machine moves by several percent from one
# measurement to the next), and plans made from two fresh caches differed (50 stages at +14.8 % with
# one, 18 stages at +4.4 % with another).  Every time the solvers see is put on a log grid of
# GRID_STEPS steps per doubling: within +-9 % of what was measured, unbiased over many ops, and a
# remeasurement lands on the same grid point unless it was within noise of a step's edge.
GRID_STEPS = 4


def on_grid(seconds: float) -> float:
    """``seconds`` rounded to the nearest of 2 ** (k / GRID_STEPS)."""
    if seconds <= 0 or not math.isfinite(seconds):
        return seconds
    return 2.0 ** (round(math.log2(seconds) * GRID_STEPS) / GRID_STEPS)


@dataclass(frozen=True)
class Machine:
    """The rates an op's time is estimated from."""

    flops_per_s: float  # dense matmul throughput
    bytes_per_s: float  # memory bandwidth of a large copy (read + write counted)
    overhead_s: float  # time of a trivial op (dispatch and launch)
    source: str  # "measured" on this machine, or where the numbers come from


# A device remat cannot run here (a GPU planned from a CPU-only machine): nominal numbers of an
# H100 SXM (NVIDIA's data sheet: 67 TFLOP/s FP32 / 495 TFLOP/s TF32 dense, 3.35 TB/s) with a few
# microseconds per launch. Only the ratios matter to the solvers.
_NOMINAL = {"cuda": Machine(100e12, 3.0e12, 5e-6, "nominal: NVIDIA H100 SXM data sheet")}


def best_of(fn: Callable[[], Any], repeat: int = 5, budget_s: float = math.inf) -> float:
    """The fastest of ``repeat`` runs of ``fn`` (a busy machine only ever slows a run down), fewer
    once the runs so far took ``budget_s``."""
    best, spent = math.inf, 0.0
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
        best, spent = min(best, seconds), spent + seconds
        if spent > budget_s:
            break
    return best


def _measure_cpu(threads: int) -> Machine:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        own = torch.Generator().manual_seed(0)  # the caller's random stream stays as it was
        a, b = torch.rand(1024, 1024, generator=own), torch.rand(1024, 1024, generator=own)
        flops = 2 * 1024**3 / best_of(lambda: torch.mm(a, b))
        big = torch.empty(16 * 2**20 // 4)
        out = torch.empty_like(big)
        bandwidth = 2 * big.numel() * 4 / best_of(lambda: out.copy_(big))
        tiny = torch.ones(1)
        overhead = best_of(lambda: torch.add(tiny, tiny), repeat=50)
    finally:
        torch.set_num_threads(before)
    return Machine(on_grid(flops), on_grid(bandwidth), on_grid(overhead), "measured")


@functools.lru_cache(maxsize=None)
def machine(device: str, threads: int) -> Machine:
    """The machine numbers for ``device`` ("cpu": measured here once and cached on disk)."""
    if device != "cpu":
        return _NOMINAL.get(device, _NOMINAL["cuda"])
    path = cache_dir() / f"machine-cpu-torch{torch.__version__}-threads{threads}.json".replace("+", "_")
    try:
        return Machine(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        pass
    found = _measure_cpu(threads)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(found)))
    except OSError:
        pass
    return found


def tensor_bytes(x: Any) -> int:
    """Bytes of every tensor in ``x`` (nested tuples and lists included)."""
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (tuple, list)):
        return sum(tensor_bytes(y) for y in x)
    if isinstance(x, dict):
        return sum(tensor_bytes(y) for y in x.values())
    return 0


def roofline_seconds(flops: int, moved_bytes: int, m: Machine) -> float:
    """An op's time by the roofline: the slower of its arithmetic and its memory traffic."""
    return on_grid(max(flops / m.flops_per_s, moved_bytes / m.bytes_per_s) + m.overhead_s)


@functools.lru_cache(maxsize=None)
def moves_no_data(func: Any) -> bool:
    """Whether the op's schema says it touches no element: every tensor it returns aliases an input
    without writing it (views, ``detach``), or it returns no tensor and writes nothing (``prim.device``,
    ``sym_size``).  Such an op costs its dispatch, not its operands' bytes: charging them made
    GPT-2's views and metadata queries 5 % of a predicted step they take 0.1 % of."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return False
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return False
    returns = [r for r in schema.returns if "Tensor" in str(r.type)]
    return all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def op_seconds(func: Any, flops: int, args: Any, out: Any, m: Machine) -> float:
    """An op's predicted time when it was not measured: its dispatch if it moves no data, else the
    roofline over the bytes it reads and writes."""
    if moves_no_data(func):
        return on_grid(m.overhead_s)
    return roofline_seconds(flops, tensor_bytes(args) + tensor_bytes(out), m)


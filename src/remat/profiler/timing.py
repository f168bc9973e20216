"""Predicted op times: what recomputing an op costs, for the solvers.

FLOPs are a poor proxy for time: recomputing a norm or an activation costs memory traffic, not
arithmetic.  An op's time is measured on the planning machine when its memory is (calibrate.py
times it, the best of a few runs outside the profiler), else estimated with a roofline: the larger of its
FLOPs at the machine's matmul rate and the bytes it reads and writes at the machine's copy
bandwidth, plus a per-op overhead.  The three machine numbers are measured once per (device type,
torch version, threads) and cached next to the kernel measurements.
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..cache import cache_dir

__all__ = ["Machine", "LoadProbe", "best_of", "machine", "moves_no_data", "op_seconds", "roofline_seconds",
           "tensor_bytes", "on_grid", "GRID_STEPS", "LOAD_FACTOR"]

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
    # what torch's selective checkpoint adds per op of a region keeping its matmul outputs: its
    # Python dispatch mode on the op in the forward and again in the recomputation (0: not measured)
    selective_op_s: float = 0.0


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


# A busy machine slows kernels unevenly: with two other processes on 2 cores, GPT-2 6 x 512's
# elementwise ops were cached 10-20x slower than on the idle machine and its matmuls 2.4x (threads
# oversubscribed wait on each other), and the plans made from that cache predicted 2.6x the
# recomputation measured.  Times measured while a small parallel op (the probe: an add over 4 MiB,
# median of 5) runs more than LOAD_FACTOR times slower than its quietest run on record serve the
# plan at hand but are not cached.  Measured on the 2-core AMD EPYC: idle, probes took 50-130 us
# (standalone processes and inside a plan; 2.6x apart); beside one busy 1- or 2-thread process,
# 5.8-12 ms when slowed, ~100x (oversubscribed threads wait on each other).  Some probes still land
# in an idle moment: a verdict is only as good as its moment.
LOAD_FACTOR = 5.0
PROBE_EVERY_S = 0.25  # a probe (~1 ms) at most this often: its verdict holds for the next measurements


@contextlib.contextmanager
def _plain() -> Iterator[None]:
    """Outside every fake and dispatch mode: the probe is called while a step is simulated."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.utils._python_dispatch import _disable_current_modes

    with unset_fake_temporarily(), _disable_current_modes():
        yield


class LoadProbe:
    """How much slower than its quietest run on record (kept next to the kernel measurements) a
    small parallel op runs now, at the plan's thread count.  The first run on record sets the bar:
    a machine busy from the start is not told apart (a limitation, written down in docs/usage.md)."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.path = cache_dir() / f"probe-cpu-torch{torch.__version__}-threads{threads}.json".replace("+", "_")
        try:
            self.quietest = float(json.loads(self.path.read_text())["seconds"])
        except (OSError, ValueError, KeyError, TypeError):
            self.quietest = math.inf
        with _plain():  # made while a step is simulated: real tensors, not fake ones
            own = torch.Generator().manual_seed(0)
            self._a = torch.rand(2**20, generator=own)  # 4 MiB: split over the threads by torch
            self._out = torch.empty_like(self._a)
        self._last = -math.inf
        self._factor = 1.0
        self._run(20)  # a fresh process's first runs start its thread pool and touch new pages (3x slower)

    def _run(self, repeat: int) -> float:
        """The median of ``repeat`` probe runs at the plan's thread count."""
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            times = []
            with _plain():
                for _ in range(repeat):
                    start = time.perf_counter()
                    torch.add(self._a, 1.0, out=self._out)
                    times.append(time.perf_counter() - start)
        finally:
            torch.set_num_threads(before)
        return sorted(times)[len(times) // 2]

    def slowdown(self) -> float:
        """The current run over the quietest (1.0 when this is the quietest yet)."""
        now = time.perf_counter()
        if now - self._last < PROBE_EVERY_S:
            return self._factor
        seconds = self._run(5)
        self._last = time.perf_counter()
        if seconds < self.quietest:
            self.quietest = seconds
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self.path.write_text(json.dumps({"seconds": seconds}))
            except OSError:
                pass
        self._factor = seconds / self.quietest
        return self._factor

    def busy(self) -> bool:
        return self.slowdown() > LOAD_FACTOR


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
        selective = _selective_op_seconds()
    finally:
        torch.set_num_threads(before)
    return Machine(on_grid(flops), on_grid(bandwidth), on_grid(overhead), "measured", on_grid(selective))


def _selective_op_seconds(ops: int = 200) -> float:
    """Per op, what a region under torch's selective checkpoint costs beyond a plain checkpoint: a
    chain of ``ops`` tiny ops, forward and backward, both ways (10.6 us on the 2-core AMD EPYC, 0.6
    us for the plain checkpoint's recomputation of such an op: the mode is most of a keeping
    region's cost on a Llama layer's ~70 small ops)."""
    from functools import partial

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.PREFER_RECOMPUTE

    def chain(x: torch.Tensor) -> torch.Tensor:
        for _ in range(ops // 2):
            x = x * 1.0001 + 0.0001
        return x

    x = torch.ones(8, requires_grad=True)

    def plain() -> None:
        checkpoint(chain, x, use_reentrant=False).sum().backward()

    def selective() -> None:
        checkpoint(chain, x, use_reentrant=False,
                   context_fn=partial(create_selective_checkpoint_contexts, policy)).sum().backward()

    with torch.enable_grad(), _plain(), torch.autocast("cpu", enabled=False):  # whatever the caller's context
        plain(), selective()
        return max(0.0, best_of(selective) - best_of(plain)) / ops


@functools.lru_cache(maxsize=None)
def machine(device: str, threads: int) -> Machine:
    """The machine numbers for ``device`` ("cpu": measured here once and cached on disk)."""
    if device != "cpu":
        return _NOMINAL.get(device, _NOMINAL["cuda"])
    path = cache_dir() / f"machine-v2-cpu-torch{torch.__version__}-threads{threads}.json".replace("+", "_")
    try:
        return Machine(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        pass
    busy = LoadProbe(threads).busy()
    found = _measure_cpu(threads)
    if busy:  # used for this process, measured again by the next
        return found
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


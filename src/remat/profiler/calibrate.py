"""Kernel scratch measured on the planning machine, cached on disk.

The memory rules (``profiler/rules/``) bound what a kernel allocates while it runs; the bounds were
measured on one CPU and cannot know another CPU's kernels, thread count or torch version.  When the
step runs on this machine's CPU and its inputs are real, each distinct op signature (op, argument
shapes, strides, dtypes and other arguments) is instead run once in isolation on real tensors of
that signature (random values in [0, 1); integer and boolean tensors are zeros, so indices stay in
range; where a kernel's scratch depends on index values, its rule declares ``value_bound`` and its
bound is kept when larger), with the plan's thread count and, where torch's current thread count
differs, with that one too: the larger scratch counts, since fewer threads can take a path with
more (upsample_bilinear2d on a strided input allocates two input-sized buffers at 1 thread and none
at 2, benchmarks/opfuzz.py seed 649).  Its memory is read from the allocator's events: its
scratch is the highest total while it runs minus what it still holds when it returns (its outputs),
and when those outputs are larger than the fake kernel's (an RNN kernel's workspace), the difference
lives and dies with them.

Measurements are keyed by (device, torch version, threads, signature) and kept in one JSON file per
(device, torch version, threads) under ``$REMAT_CACHE_DIR`` (default ``~/.cache/remat``): each
signature is measured once per machine setup and reused across runs and models.  Ops that cannot
run in isolation (data-dependent output shapes, values they reject, an opaque workspace argument
that only the forward kernel can fill) keep the rules' bound.
"""
from __future__ import annotations

import functools
import json
import math
import os
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch._ops import OpOverload

from ..cache import cache_dir
from ..errors import RematWarning
from ..instrument import cpu_window
from .dispatch import KernelMemory, RuleScratch, Target
from .memory import tensors_in
from .rules import MemoryRule, RuleContext
from .timing import LoadProbe, best_of, on_grid

__all__ = ["ScratchCache", "Calibration", "signature", "cache_dir", "calibration_for"]

# Tags of ops whose outputs depend on input values: random inputs say nothing about their memory.
_DATA_DEPENDENT = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)
# Arguments that carry a kernel's private state between its forward and backward (the RNN kernels'
# workspace, cuDNN's reserve): random bytes there make the kernel read out of bounds (the fake
# forward even returns an empty workspace), so such ops are run only with a recipe that makes that
# state with the forward kernel first (found by benchmarks/opfuzz.py: mkldnn_rnn_layer_backward
# crashed on random arguments).
_OPAQUE_ARGS = frozenset({"workspace", "reserve", "weight_buf", "dropout_state"})


def _mkldnn_rnn_backward(args: list[Any]) -> list[Any]:
    """oneDNN's LSTM backward reads the workspace its forward wrote: run the forward on the same
    inputs and weights, and pass its outputs and workspace."""
    (x, w1, w2, w3, w4, hx, cx, _, _, _, _, _, _, reverse, mode, hidden, layers, biases, train, bidirectional,
     batch_sizes, batch_first, _) = args
    with torch.enable_grad():  # (called from a backward, where grad mode is off: no workspace then)
        out, hy, cy, workspace = torch.ops.aten.mkldnn_rnn_layer(x, w1, w2, w3, w4, hx, cx, reverse, batch_sizes,
                                                                 mode, hidden, layers, biases, bidirectional,
                                                                 batch_first, train)
    args = list(args)
    args[7], args[8], args[9], args[22] = out, hy, cy, workspace
    return args


# op -> how to make its opaque arguments from the others (real tensors in, real tensors out)
_RECIPES: dict[Any, Callable[[list[Any]], list[Any]]] = {}
if hasattr(torch.ops.aten, "mkldnn_rnn_layer_backward"):
    _RECIPES[torch.ops.aten.mkldnn_rnn_layer_backward.default] = _mkldnn_rnn_backward


# Bumped whenever what a measurement means changes, so no file from an older remat is read
# (4: times are the best of up to TIMED_RUNS runs, not one).
FORMAT = 5
# An op's time: the fastest of this many runs after the profiled one (which warmed it up).  One run
# read on a busy machine stays in the cache for good: in format 3, a 512x256 @ 256x256 addmm read
# 24 ms (2.7 GFLOP/s on a machine measured at 39 GFLOP/s), a layer norm of 128k floats 12 ms.
TIMED_RUNS = 3
TIMED_BUDGET_S = 0.05  # ... fewer when one run already takes this long


def _describe(x: Any) -> Any:
    """A stable, JSON-friendly description of one argument for the signature."""
    if isinstance(x, torch.Tensor):
        return ["T", list(x.shape), list(x.stride()), x.storage_offset(), str(x.dtype).removeprefix("torch."),
                x.untyped_storage().nbytes()]
    if isinstance(x, (list, tuple)):
        return [_describe(y) for y in x]
    if isinstance(x, (bool, int, str)) or x is None:
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else repr(x)
    return str(x)  # dtypes, devices, layouts, memory formats


def signature(func: OpOverload, args: tuple, kwargs: dict) -> str:
    return json.dumps([str(func), _describe(args), _describe(sorted(kwargs.items()))], separators=(",", ":"))


@functools.lru_cache(maxsize=None)
def _measurable(func: OpOverload) -> bool:
    """Ops worth running: not views or metadata (they allocate nothing), not data-dependent."""
    if func.namespace == "prim" or any(tag in func.tags for tag in _DATA_DEPENDENT):
        return False
    if func not in _RECIPES and any(a.name in _OPAQUE_ARGS for a in func._schema.arguments):
        return False
    returns = [r for r in func._schema.returns if "Tensor" in str(r.type)]
    return bool(returns) and not all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


class ScratchCache:
    """Measured scratch by signature, for one (device, torch version, thread count), on disk."""

    _open: dict[Path, "ScratchCache"] = {}
    _lock = threading.Lock()

    def __init__(self, path: Path) -> None:
        self.path = path
        # [scratch, output bytes, output strides, seconds, each output's storage bytes]; None: the op
        # could not run in isolation
        self.values: dict[str, list[Any] | None] = {}
        self.new: dict[str, list[Any] | None] = {}
        if path.exists():
            try:
                self.values = json.loads(path.read_text())
            except (OSError, ValueError):
                self.values = {}  # a damaged cache is only a slower plan

    @classmethod
    def for_target(cls, target: Target) -> "ScratchCache":
        name = f"kernels-v{FORMAT}-{target.device.type}-torch{torch.__version__}-threads{target.threads}.json"
        path = cache_dir() / name.replace("+", "_")
        with cls._lock:
            if path not in cls._open:
                cls._open[path] = cls(path)
            return cls._open[path]

    def get(self, key: str) -> tuple[bool, list[Any] | None]:
        return (key in self.values, self.values.get(key))

    def put(self, key: str, value: list[Any] | None) -> None:
        self.values[key] = value
        self.new[key] = value

    def flush(self) -> None:
        """Merge the new measurements into the file (atomically; other processes may write too)."""
        if not self.new:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            on_disk = json.loads(self.path.read_text()) if self.path.exists() else {}
        except (OSError, ValueError):
            on_disk = {}
        on_disk.update(self.new)
        try:
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".scratch-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump(on_disk, f)
            os.replace(tmp, self.path)
            self.new = {}
        except OSError:
            pass  # a read-only home: keep the measurements for this process only


def _real_twin(t: torch.Tensor, memo: dict[int, torch.Tensor]) -> torch.Tensor:
    """A real CPU tensor with ``t``'s size, strides, offset and dtype, over a storage as large."""
    if id(t) in memo:
        return memo[id(t)]
    count = max(1, -(-t.untyped_storage().nbytes() // t.element_size()))
    if t.is_floating_point() or t.is_complex():
        base = torch.rand(count, dtype=t.dtype)
    else:
        base = torch.zeros(count, dtype=t.dtype)
    real = base.as_strided(t.shape, t.stride(), t.storage_offset())
    memo[id(t)] = real
    return real


def _realize(x: Any, memo: dict[int, torch.Tensor]) -> Any:
    if isinstance(x, torch.Tensor):
        return _real_twin(x, memo)
    if isinstance(x, (list, tuple)):
        return type(x)(_realize(y, memo) for y in x)
    return x


def _new_bytes(args: tuple, kwargs: dict, out: Any) -> int:
    """Bytes of the output storages that are not input storages (what the fake kernel allocated)."""
    inputs = {id(t.untyped_storage()) for t in tensors_in((args, kwargs))}
    new = {id(st): st.nbytes() for st in (t.untyped_storage() for t in tensors_in(out)) if id(st) not in inputs}
    return sum(new.values())


def _larger_outputs(args: tuple, kwargs: dict, out: Any, sizes: list[int | None]) -> tuple[int, ...]:
    """Per output: the bytes its real storage holds beyond the fake one (0 for outputs that alias
    an input, or a storage an earlier output already has)."""
    fake = list(out) if isinstance(out, (tuple, list)) else [out]
    if len(fake) != len(sizes):
        return ()
    inputs = {id(t.untyped_storage()) for t in tensors_in((args, kwargs))}
    seen: set[int] = set()
    extra = []
    for t, real in zip(fake, sizes):
        key = id(t.untyped_storage()) if isinstance(t, torch.Tensor) else None
        if key is None or real is None or key in inputs or key in seen:
            extra.append(0)
            continue
        seen.add(key)
        extra.append(max(0, real - t.untyped_storage().nbytes()))
    return tuple(extra) if any(extra) else ()


def measure_kernel(func: OpOverload, args: tuple, kwargs: dict, threads: int) -> list[Any] | None:
    """Run ``func`` once on real CPU tensors shaped like ``args``: [its scratch, the bytes its
    outputs hold, their strides, its run time, each output's storage bytes], or None when it
    cannot run that way."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    rng = torch.default_generator.get_state()  # (not torch.get_rng_state: the simulation counts those)
    # the op runs as recorded: an autocast the caller planned under must not cast its operands again
    with unset_fake_temporarily(), torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
        memo: dict[int, torch.Tensor] = {}
        real_args, real_kwargs = _realize(args, memo), {k: _realize(v, memo) for k, v in kwargs.items()}
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            if func in _RECIPES:
                real_args = tuple(_RECIPES[func](list(real_args)))
            window = cpu_window(lambda: func(*real_args, **real_kwargs))
            seconds = best_of(lambda: func(*real_args, **real_kwargs), TIMED_RUNS, TIMED_BUDGET_S)
        except Exception:  # noqa: BLE001 - values the op rejects, unsupported on this build, ...
            return None
        finally:
            torch.set_num_threads(before)
            torch.default_generator.set_state(rng)
    outputs = window.value if isinstance(window.value, (tuple, list)) else [window.value]
    strides = [list(t.stride()) if isinstance(t, torch.Tensor) else None for t in outputs]
    sizes = [t.untyped_storage().nbytes() if isinstance(t, torch.Tensor) else None for t in outputs]
    return [max(0, window.peak - window.end), window.end, strides, seconds, sizes]


@dataclass
class Calibration:
    """A ScratchSource that measures each op signature once on this machine (see the module
    docstring), falling back to the rules for what cannot be measured."""

    target: Target
    limit_bytes: int  # signatures whose tensors exceed this are not run (the rules' bound is used)
    # other thread counts the step may run with (torch's current one, when the plan assumes more):
    # the scratch is the largest measured; fewer threads can take a path with more
    also_threads: tuple[int, ...] = ()
    cache: ScratchCache = field(init=False)
    measured: int = 0  # signatures measured during this plan
    reused: int = 0  # op calls answered from the cache
    estimated: int = 0  # op calls left to the rules
    seconds: float = 0.0  # time spent measuring
    largest_bytes: int = 0  # the most real memory one measurement took (its tensors and scratch)
    busy_measured: int = 0  # signatures measured while the machine was busy: not cached
    _fallback: RuleScratch = field(default_factory=RuleScratch)

    def __post_init__(self) -> None:
        self.cache = ScratchCache.for_target(self.target)
        self._also = tuple((t, ScratchCache.for_target(replace(self.target, threads=t)))
                           for t in sorted(set(self.also_threads)) if t != self.target.threads)
        self._probes: dict[int, LoadProbe] = {}
        self._busy_values: dict[tuple[int, str], list[Any] | None] = {}

    def _value(self, cache: ScratchCache, threads: int, func: OpOverload, args: tuple, kwargs: dict,
               out: Any, count: bool = True) -> list[Any] | None:
        """The cached or newly measured [scratch, held, strides, seconds] at ``threads``; None when
        the op cannot run in isolation or its tensors are too large to run here.  ``count``: an op
        call's first lookup (the others, at other thread counts, are not calls of their own)."""
        key = signature(func, args, kwargs)
        known, value = cache.get(key)
        if not known and (threads, key) in self._busy_values:
            known, value = True, self._busy_values[(threads, key)]
        if known:
            self.reused += count
            return value
        size = sum(t.untyped_storage().nbytes() for t in tensors_in((args, kwargs, out)))
        if size > self.limit_bytes:
            return None
        start = time.perf_counter()
        busy = self._probe(threads).busy()
        value = measure_kernel(func, args, kwargs, threads)
        self.seconds += time.perf_counter() - start
        self.largest_bytes = max(self.largest_bytes, size + (value[0] if value else 0))
        if busy:  # this plan uses it; the cache waits for an idle machine (timing.LOAD_FACTOR)
            self._busy_values[(threads, key)] = value
            self._warn_busy(threads)
        else:
            cache.put(key, value)
        self.measured += 1
        return value

    def _probe(self, threads: int) -> LoadProbe:
        if threads not in self._probes:
            self._probes[threads] = LoadProbe(threads)
        return self._probes[threads]

    def _warn_busy(self, threads: int) -> None:
        self.busy_measured += 1
        if self.busy_measured == 1:
            warnings.warn(f"the machine is busy: a probe op runs {self._probe(threads).slowdown():.1f}x slower than "
                          "when idle, so the op times remat measures now are used for this plan but not cached "
                          "(busy cores slow some ops far more than others: plan on an idle machine for the best "
                          "plan)", RematWarning, stacklevel=2)

    def kernel(self, func: Any, args: tuple, kwargs: dict, out: Any, rules: tuple[MemoryRule, ...],
               ctx: RuleContext) -> KernelMemory:
        if not isinstance(func, OpOverload) or not _measurable(func):
            return self._fallback.kernel(func, args, kwargs, out, rules, ctx)
        value = self._value(self.cache, self.target.threads, func, args, kwargs, out)
        if value is None:
            return self._estimate(func, args, kwargs, out, rules, ctx)
        scratch, held, strides, seconds, sizes = value
        for threads, cache in self._also:
            other = self._value(cache, threads, func, args, kwargs, out, count=False)
            scratch = max(scratch, other[0] if other else 0)
        if any(r.value_bound is not None and r.scratch is not None and r.value_bound(args, kwargs) for r in rules):
            # measured on zero indices, which cannot show scratch that depends on index values
            scratch = max(scratch, self._fallback.kernel(func, args, kwargs, out, rules, ctx).scratch)
        per_out = _larger_outputs(args, kwargs, out, sizes)
        return KernelMemory(scratch, max(0, held - _new_bytes(args, kwargs, out) - sum(per_out)),
                            strides=tuple(None if st is None else tuple(st) for st in strides),
                            seconds=None if seconds is None else on_grid(seconds),
                            extra_per_out=per_out)

    def _estimate(self, func: Any, args: tuple, kwargs: dict, out: Any, rules: tuple[MemoryRule, ...],
                  ctx: RuleContext) -> KernelMemory:
        self.estimated += 1
        return self._fallback.kernel(func, args, kwargs, out, rules, ctx)

    def flush(self) -> None:
        self.cache.flush()
        for _, cache in self._also:
            cache.flush()


def _available_memory() -> int:
    """Memory the system can still give this process (MemAvailable), or 4 GiB when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * 2**30


# One op's tensors may take at most this share of the free memory to be measured: the rest of the
# planning process (fake tensors, the solver) must keep running beside it.
MEASURE_SHARE = 0.25


def calibration_for(target: Target, tensors: Iterable[torch.Tensor], enabled: bool | None = None) -> Calibration | None:
    """A Calibration when scratch can be measured for ``target`` here: the target is this
    machine's CPU and the model's state and inputs are real (not meta), else None (the rules).

    ``enabled``: True/False force it on or off (on is refused for another device); None decides
    as above, and ``REMAT_CALIBRATE=0`` in the environment turns it off.
    """
    if enabled is False or (enabled is None and os.environ.get("REMAT_CALIBRATE", "1") == "0"):
        return None
    if target.device.type != "cpu":
        if enabled:
            raise ValueError(f"scratch can only be measured on this machine's CPU, not on {target.device} "
                             "(a CUDA plan's scratch comes from the cuda memory rules)")
        return None
    if enabled is None and any(t.device.type == "meta" for t in tensors):
        return None
    return Calibration(target, int(MEASURE_SHARE * _available_memory()), also_threads=(torch.get_num_threads(),))

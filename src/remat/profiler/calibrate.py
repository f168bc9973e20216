"""Kernel scratch measured on the planning machine, cached on disk.

The memory rules (``profiler/rules/``) bound what a kernel allocates while it runs; the bounds were
measured on one CPU and cannot know another CPU's kernels, thread count or torch version.  When the
step runs on this machine's CPU and its inputs are real, each distinct op signature (op, argument
shapes, strides, dtypes and other arguments) is instead run once in isolation on real tensors of
that signature (random values in [0, 1); integer and boolean tensors are zeros, so indices stay in
range), with the plan's thread count, and its scratch is read from the allocator's events: the
highest total while it runs minus what it still holds when it returns (its outputs).

Measurements are keyed by (device, torch version, threads, signature) and kept in one JSON file per
(device, torch version, threads) under ``$REMAT_CACHE_DIR`` (default ``~/.cache/remat``): each
signature is measured once per machine setup and reused across runs and models.  Ops that cannot
run in isolation (data-dependent output shapes, values they reject) keep the rules' bound.
"""
from __future__ import annotations

import functools
import json
import math
import os
import tempfile
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch._ops import OpOverload

from ..instrument import cpu_window
from .dispatch import RuleScratch, Target
from .rules import MemoryRule, RuleContext

__all__ = ["ScratchCache", "Calibration", "signature", "cache_dir", "calibration_for"]

# Tags of ops whose outputs depend on input values: random inputs say nothing about their memory.
_DATA_DEPENDENT = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)


def cache_dir() -> Path:
    return Path(os.environ.get("REMAT_CACHE_DIR") or Path.home() / ".cache" / "remat")


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
    returns = [r for r in func._schema.returns if "Tensor" in str(r.type)]
    return bool(returns) and not all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


class ScratchCache:
    """Measured scratch by signature, for one (device, torch version, thread count), on disk."""

    _open: dict[Path, "ScratchCache"] = {}
    _lock = threading.Lock()

    def __init__(self, path: Path) -> None:
        self.path = path
        self.values: dict[str, int | None] = {}  # None: the op could not run in isolation
        self.new: dict[str, int | None] = {}
        if path.exists():
            try:
                self.values = json.loads(path.read_text())
            except (OSError, ValueError):
                self.values = {}  # a damaged cache is only a slower plan

    @classmethod
    def for_target(cls, target: Target) -> "ScratchCache":
        name = f"scratch-{target.device.type}-torch{torch.__version__}-threads{target.threads}.json"
        path = cache_dir() / name.replace("+", "_")
        with cls._lock:
            if path not in cls._open:
                cls._open[path] = cls(path)
            return cls._open[path]

    def get(self, key: str) -> tuple[bool, int | None]:
        return (key in self.values, self.values.get(key))

    def put(self, key: str, value: int | None) -> None:
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


def _tensors(x: Any) -> Iterable[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


def measure_scratch(func: OpOverload, args: tuple, kwargs: dict, threads: int) -> int | None:
    """Run ``func`` once on real CPU tensors shaped like ``args``; its scratch in bytes, or None
    when it cannot run that way."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    rng = torch.default_generator.get_state()  # (not torch.get_rng_state: the simulation counts those)
    with unset_fake_temporarily():
        memo: dict[int, torch.Tensor] = {}
        real_args, real_kwargs = _realize(args, memo), {k: _realize(v, memo) for k, v in kwargs.items()}
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            window = cpu_window(lambda: func(*real_args, **real_kwargs))
        except Exception:  # noqa: BLE001 - values the op rejects, unsupported on this build, ...
            return None
        finally:
            torch.set_num_threads(before)
            torch.default_generator.set_state(rng)
    return max(0, window.peak - window.end)


@dataclass
class Calibration:
    """A ScratchSource that measures each op signature once on this machine (see the module
    docstring), falling back to the rules for what cannot be measured."""

    target: Target
    limit_bytes: int  # signatures whose tensors exceed this are not run (the rules' bound is used)
    cache: ScratchCache = field(init=False)
    measured: int = 0  # signatures measured during this plan
    reused: int = 0  # op calls answered from the cache
    estimated: int = 0  # op calls left to the rules
    _fallback: RuleScratch = field(default_factory=RuleScratch)

    def __post_init__(self) -> None:
        self.cache = ScratchCache.for_target(self.target)

    def scratch(self, func: Any, args: tuple, kwargs: dict, out: Any, rules: tuple[MemoryRule, ...],
                ctx: RuleContext) -> int:
        if not isinstance(func, OpOverload) or not _measurable(func):
            return self._fallback.scratch(func, args, kwargs, out, rules, ctx)
        key = signature(func, args, kwargs)
        known, value = self.cache.get(key)
        if known:
            if value is None:
                return self._estimate(func, args, kwargs, out, rules, ctx)
            self.reused += 1
            return value
        size = sum(t.untyped_storage().nbytes() for t in _tensors((args, kwargs, out)))
        if size > self.limit_bytes:
            return self._estimate(func, args, kwargs, out, rules, ctx)
        value = measure_scratch(func, args, kwargs, ctx.threads)
        self.cache.put(key, value)
        self.measured += 1
        if value is None:
            return self._estimate(func, args, kwargs, out, rules, ctx)
        return value

    def _estimate(self, func: Any, args: tuple, kwargs: dict, out: Any, rules: tuple[MemoryRule, ...],
                  ctx: RuleContext) -> int:
        self.estimated += 1
        return self._fallback.scratch(func, args, kwargs, out, rules, ctx)

    def flush(self) -> None:
        self.cache.flush()


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
            raise ValueError(f"scratch can only be measured on this machine's CPU, not on {target.device}")
        return None
    if enabled is None and any(t.device.type == "meta" for t in tensors):
        return None
    return Calibration(target, int(MEASURE_SHARE * _available_memory()))

"""The memory-rule registry: what a real kernel allocates that its fake outputs do not show.

Fake tensors give every op's outputs with their sizes, strides and aliasing, so views and in-place
results land on storages that already exist and new outputs are new storages: the simulated
allocator (``profiler/memory.py``) follows those by itself.  The exceptions are declared here, one
entry per aspect of an op on a device type ("cpu", "cuda", or "*" for all), and applied by one
dispatch path (``profiler/dispatch.py``) for the per-node profile and the step simulation alike:

* ``scratch``: bytes a kernel allocates and frees while it runs, above its outputs (workspaces,
  reorders, per-thread partials).  Measured on the planning machine when it can run the op
  (``profiler/calibrate.py``); these rules are the fallback and are meant as upper bounds.
* ``layout``: outputs the real kernel lays out differently (the layout decides what later kernels
  copy).
* ``dropped``: outputs a fake kernel returns that the real kernel does not allocate.
* ``extra_out``: bytes a kernel allocates with its outputs beyond what the fake outputs hold, freed
  with them (an RNN workspace the fake kernel returns empty).
* ``held``: bytes allocated outside any op that stay until the step ends (autograd's saved scalars).
* ``writes``: argument positions the op writes without its schema saying so (BatchNorm statistics).
* ``workspace`` (with ``op=None``): bytes a library allocates on the device at its first use and
  keeps for the life of the process (cuBLAS's workspace): every step after the first starts with
  them, so they count as resident bytes of the step.
* ``granularity`` (with ``op=None``): every allocation on the device is rounded up to a multiple of
  it (the CUDA caching allocator's block size).
* ``value_bound`` (with ``scratch``): a predicate of the op's arguments saying when its scratch
  depends on the values of its integer arguments (which bags are empty, which index won a max).
  Calibration runs ops on zeros, which cannot show that, so there the rule's bound is kept when it
  is larger than the measurement.

Every rule carries ``doc`` (what it models) and ``source`` (the measurement or derivation behind its
numbers); ``python -m remat.profiler.docs --memory`` renders the table in docs/memory.md.
"""
from __future__ import annotations

import functools
from typing import Any

from torch._ops import OpOverload

from .registry import RULES, MemoryRule, RuleContext, nbytes, rule, scratch_rule

__all__ = ["RuleContext", "MemoryRule", "RULES", "rule", "rules_for", "scratch_rule", "hidden_writes", "written_arguments", "unreturned_writes", "nbytes",
           "granularity", "round_up", "workspace_bytes"]


def rules_for(op: OpOverload, device: str) -> tuple[MemoryRule, ...]:
    """The rules of ``op`` on ``device`` (and on every device)."""
    _load()
    return _rules_for(op, device, len(RULES))  # (a rule registered later starts a new cache key)


@functools.lru_cache(maxsize=None)
def _rules_for(op: OpOverload, device: str, known: int) -> tuple[MemoryRule, ...]:
    """Every rule that applies to ``op`` on ``device`` (device-specific ones and "*" ones)."""
    return tuple(r for r in RULES if r.device in (device, "*")
                 and (r.op is op or (r.op is None and (r.applies is None or r.applies(op)))))


@functools.lru_cache(maxsize=None)
def hidden_writes(op: OpOverload) -> tuple[int, ...]:
    """Arguments ``op`` writes: those its schema marks, and those a rule declares."""
    written = [i for i, a in enumerate(op._schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
    for r in rules_for(op, "*"):
        written.extend(r.writes)
    return tuple(sorted(set(written)))


def written_arguments(op: OpOverload, args: tuple, kwargs: dict) -> list[tuple[int, int | str, Any]]:
    """The values a call of ``op`` writes: (schema index, key, value), the key a position for
    positional arguments and a name for keyword ones (``out=``: F.normalize(..., out=buf) writes
    ``buf`` through a kwarg)."""
    schema = op._schema.arguments
    written: list[tuple[int, int | str, Any]] = []
    for i in hidden_writes(op):
        if i < len(args):
            written.append((i, i, args[i]))
        elif i < len(schema) and schema[i].name in kwargs:
            written.append((i, schema[i].name, kwargs[schema[i].name]))
    return written


@functools.lru_cache(maxsize=None)
def unreturned_writes(op: OpOverload) -> frozenset[int]:
    """Written arguments ``op`` does not return (rrelu's ``noise``; BatchNorm's statistics): its
    autograd node may save one before the kernel writes it."""
    returned = {a for r in op._schema.returns if r.alias_info is not None for a in r.alias_info.before_set}
    schema = op._schema.arguments
    return frozenset(i for i in hidden_writes(op)
                     if i >= len(schema) or schema[i].alias_info is None
                     or not set(schema[i].alias_info.before_set) & returned)


def granularity(device: str) -> int:
    """The allocation granularity on ``device`` (1: bytes are counted as they are)."""
    _load()
    return _granularity(device, len(RULES))


@functools.lru_cache(maxsize=None)
def _granularity(device: str, known: int) -> int:
    return max([r.granularity for r in RULES if r.device == device and r.granularity] or [1])


def workspace_bytes(ctx: RuleContext) -> int:
    """Library workspaces resident on ``ctx.device`` once a step has run (the rules' ``workspace``)."""
    _load()
    return sum(r.workspace(ctx) for r in RULES if r.device == ctx.device and r.workspace is not None)


def round_up(nbytes: int, device: str) -> int:
    """``nbytes`` as the allocator of ``device`` counts it (0 stays 0: an empty tensor allocates nothing)."""
    step = granularity(device)
    return nbytes if step == 1 or nbytes <= 0 else -(-nbytes // step) * step


def _load() -> None:
    from . import common, cpu, cpu_conv, cpu_generic, cpu_nn, cuda  # noqa: F401  (each registers its rules on import)

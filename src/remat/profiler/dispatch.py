"""The one dispatch path of every memory prediction: fake ops, their storages, the memory rules.

``AccountingMode`` runs each aten op on fake tensors and tells the simulated allocator what the real
kernel allocates: the op's new output storages (with the layouts and dropped outputs the rules
declare), bytes autograd holds outside any op, and the kernel's scratch (measured on this machine
where possible, else the rules' bound).  An optional observer sees every op after it (the profile
pass counts FLOPs and attributes memory to graph nodes there).  ``Simulation`` sets up one fake
training step around it; the per-node profile (``node.py``) and ``simulate_step`` both use it.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..fake import FakeSession, module_of
from ..step import reparametrized
from .flops import decomposes, run_op
from .memory import StorageTracker, storages_of
from .rules import MemoryRule, RuleContext, rules_for
from .rules.composites import EagerComposites

__all__ = ["Target", "ScratchSource", "RuleScratch", "AccountingMode", "Simulation", "default_threads"]


def default_threads() -> int:
    """The CPU threads a plan assumes: what torch uses now, or every core this process may use if
    that is more (torch's default), so a plan made with fewer threads still holds at the default."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(torch.get_num_threads(), cores)


@dataclass(frozen=True)
class Target:
    """Where the predicted step runs: the device (type), and the CPU threads the plan assumes."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    threads: int = field(default_factory=default_threads)

    @property
    def context(self) -> RuleContext:
        return RuleContext(self.device.type, self.threads)


class ScratchSource(Protocol):
    """Where kernel scratch comes from: the rules' bounds, or measurements (profiler/calibrate.py)."""

    def scratch(self, func: Any, args: tuple, kwargs: dict, out: Any, rules: tuple[MemoryRule, ...],
                ctx: RuleContext) -> int: ...


class RuleScratch:
    """Scratch from the registered rules alone."""

    def scratch(self, func: Any, args: tuple, kwargs: dict, out: Any, rules: tuple[MemoryRule, ...],
                ctx: RuleContext) -> int:
        return sum(r.scratch(args, kwargs, out, ctx) for r in rules if r.scratch is not None)


def _op_device(args: tuple, out: Any) -> str | None:
    for t in (*args, *(out if isinstance(out, (tuple, list)) else (out,))):
        if isinstance(t, torch.Tensor):
            return t.device.type
    return None


Observer = Callable[..., None]  # (func, args, kwargs, out, as_is=True)


class AccountingMode(TorchDispatchMode):
    """Applies the memory rules of every op to ``tracker``; then calls ``observer`` (if any)."""

    def __init__(self, tracker: StorageTracker, target: Target, scratch: ScratchSource | None = None,
                 observer: Observer | None = None) -> None:
        super().__init__()
        self.tracker = tracker
        self.ctx = target.context
        self.scratch = scratch or RuleScratch()
        self.observer = observer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.observer is not None and decomposes(func):
            self.observer(func, args, kwargs, None, False)  # it runs as its parts, seen one by one
        out, as_is = run_op(self, func, args, kwargs)
        if not as_is:
            return out
        out = self.account(func, args, kwargs, out)
        if self.observer is not None:
            self.observer(func, args, kwargs, out)
        return out

    def account(self, func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
        device = _op_device(args, out)
        rules = rules_for(func, device) if device is not None else ()
        for r in rules:
            if r.layout is not None:
                out = r.layout(args, out)
        allocated = out
        for r in rules:
            if r.dropped is not None:
                allocated = r.dropped(args, allocated)
        self.tracker.allocate(storages_of(allocated))
        self.tracker.hold(sum(r.held(args, self.ctx) for r in rules if r.held is not None))
        if device == self.ctx.device:
            self.tracker.transient(self.scratch.scratch(func, args, kwargs, out, rules, self.ctx))
        return out


@contextmanager
def _tracked_rng_state(tracker: StorageTracker) -> Iterator[None]:
    """torch.utils.checkpoint stashes the CPU RNG state (a real 5 KB tensor, made outside any op)
    for every region that preserves it; count those like any other storage."""
    original = torch.get_rng_state

    def get_rng_state() -> torch.Tensor:
        state = original()
        tracker.allocate([state.untyped_storage()])
        return state

    torch.get_rng_state = get_rng_state
    try:
        yield
    finally:
        torch.get_rng_state = original


class Simulation:
    """One fake training step of ``fn``: fake twins of its state and inputs, the resident storages
    marked, and (inside ``running()``) the accounting mode on top of the fake mode."""

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict | None = None,
                 target: Target | None = None, scratch: ScratchSource | None = None) -> None:
        self.fn = fn
        self.module = module_of(fn)
        self.session = FakeSession.for_call(self.module, args, kwargs)
        self.target = target or Target(self.session.device)
        self.scratch = scratch
        self.state = self.session.state(self.module) if self.module is not None else {}
        self.args = self.session.tree(tuple(args))
        self.kwargs = self.session.tree(kwargs or {})
        flat, _ = tree_flatten((self.args, self.kwargs))
        self.inputs = [t for t in flat if isinstance(t, torch.Tensor)]
        self.tracker = StorageTracker()
        self.tracker.mark_resident([*self.state.values(), *self.inputs])

    @contextmanager
    def running(self, observer: Observer | None = None) -> Iterator[AccountingMode]:
        mode = AccountingMode(self.tracker, self.target, self.scratch, observer)
        with ExitStack() as stack:
            stack.enter_context(self.session.mode)
            stack.enter_context(reparametrized(self.module, self.state))
            stack.enter_context(_tracked_rng_state(self.tracker))
            stack.enter_context(EagerComposites())
            stack.enter_context(mode)
            yield mode

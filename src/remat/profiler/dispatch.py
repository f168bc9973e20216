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
from .rules import MemoryRule, RuleContext, round_up, rules_for, workspace_bytes
from .rules.composites import EagerComposites
from .standin import fake_device_for, init_cuda_context, stand_in

__all__ = ["Target", "KernelMemory", "ScratchSource", "RuleScratch", "AccountingMode", "Simulation", "default_threads"]


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

    @property
    def fake_device(self) -> torch.device:
        """Where the step's fake tensors live here: the device, or the CPU standing in for a GPU this
        machine lacks (profiler/standin.py)."""
        return fake_device_for(self.device)

    @property
    def stand_in(self) -> bool:
        return self.fake_device.type != self.device.type

    @property
    def workspace(self) -> int:
        """Library workspaces resident on the device once a step has run (cuBLAS's; the rules)."""
        return workspace_bytes(self.context)

    def allocated(self, nbytes: int) -> int:
        """``nbytes`` as this device's allocator counts an allocation of them (rules' granularity)."""
        return round_up(nbytes, self.device.type)


@dataclass(frozen=True)
class KernelMemory:
    """What one op allocates beyond the storages of its fake outputs."""

    scratch: int = 0  # allocated and freed while it runs
    extra_out: int = 0  # allocated with its outputs and freed with them (the real outputs are larger)
    # per output, in order: bytes its real storage holds beyond the fake one's (native_batch_norm's
    # statistics are float32 on the CPU for a bfloat16 input, bfloat16 in the fake kernel); each
    # lives and dies with its own output, unlike ``extra_out``, charged to the first
    extra_per_out: tuple[int, ...] = ()
    strides: tuple[tuple[int, ...] | None, ...] | None = None  # the real outputs' strides, in order
    seconds: float | None = None  # its run time measured on this machine (None: not measured)


def _flat(out: Any) -> list[Any]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def relayout(out: Any, strides: tuple[tuple[int, ...] | None, ...], inputs: set[int]) -> Any:
    """``out`` with each new output laid out as the real kernel lays it out (a fake kernel keeps its
    input's strides where the CPU kernel returns a contiguous result, say): the layout decides what
    later ops copy.  Outputs that alias an input are left alone.  Runs under the fake mode."""
    flat = _flat(out)
    if len(flat) != len(strides):
        return out
    changed = False
    for i, (t, want) in enumerate(zip(flat, strides)):
        if (isinstance(t, torch.Tensor) and want is not None and tuple(t.stride()) != tuple(want)
                and id(t.untyped_storage()) not in inputs and len(want) == t.dim()):
            flat[i] = torch.empty_strided(t.shape, want, dtype=t.dtype, device=t.device)
            changed = True
    if not changed:
        return out
    return flat[0] if isinstance(out, torch.Tensor) else type(out)(flat)

class ScratchSource(Protocol):
    """Where kernel memory comes from: the rules' bounds, or measurements (profiler/calibrate.py)."""

    def kernel(self, func: Any, args: tuple, kwargs: dict, out: Any, rules: tuple[MemoryRule, ...],
               ctx: RuleContext) -> KernelMemory: ...


class RuleScratch:
    """Kernel memory from the registered rules alone."""

    def kernel(self, func: Any, args: tuple, kwargs: dict, out: Any, rules: tuple[MemoryRule, ...],
               ctx: RuleContext) -> KernelMemory:
        return KernelMemory(sum(r.scratch(args, kwargs, out, ctx) for r in rules if r.scratch is not None),
                            sum(r.extra_out(args, kwargs, out, ctx) for r in rules if r.extra_out is not None))


def _op_device(args: tuple, out: Any) -> str | None:
    for t in (*args, *(out if isinstance(out, (tuple, list)) else (out,))):
        if isinstance(t, torch.Tensor):
            return t.device.type
    return None


Observer = Callable[..., None]  # (func, args, kwargs, out, as_is=True, kernel=None)


class AccountingMode(TorchDispatchMode):
    """Applies the memory rules of every op to ``tracker``; then calls ``observer`` (if any)."""

    def __init__(self, tracker: StorageTracker, target: Target, scratch: ScratchSource | None = None,
                 observer: Observer | None = None) -> None:
        super().__init__()
        self.tracker = tracker
        self.ctx = target.context
        self.scratch = scratch or RuleScratch()
        self.observer = observer
        # ops on the stand-in's device run as the target's (profiler/standin.py)
        self.stand_in = target.fake_device.type if target.stand_in else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.observer is not None and decomposes(func):
            self.observer(func, args, kwargs, None, False, None)  # it runs as its parts, seen one by one
        out, as_is = run_op(self, func, args, kwargs)
        if not as_is:
            return out
        out, kernel = self.account(func, args, kwargs, out)
        if self.observer is not None:
            self.observer(func, args, kwargs, out, True, kernel)
        return out

    def account(self, func: Any, args: tuple, kwargs: dict, out: Any) -> tuple[Any, KernelMemory]:
        device = _op_device(args, out)
        if device is not None and device == self.stand_in:
            device = self.ctx.device
        rules = rules_for(func, device) if device is not None else ()
        kernel = (self.scratch.kernel(func, args, kwargs, out, rules, self.ctx) if device == self.ctx.device
                  else KernelMemory())
        for r in rules:
            if r.layout is not None:
                out = r.layout(args, out)
        if kernel.strides is not None:
            inputs = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
            out = relayout(out, kernel.strides, inputs)
        allocated = out
        for r in rules:
            if r.dropped is not None:
                allocated = r.dropped(args, allocated)
        new = [st for st in storages_of(allocated) if self.tracker.is_new(st)]
        self.tracker.allocate(new)
        self.tracker.hold(sum(r.held(args, self.ctx) for r in rules if r.held is not None))
        if kernel.extra_out and new:
            self.tracker.grow(new[0], kernel.extra_out)
        if kernel.extra_per_out:
            grown: set[int] = set()
            for t, extra in zip(_flat(out), kernel.extra_per_out):
                if extra and isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in grown:
                    grown.add(id(t.untyped_storage()))
                    self.tracker.grow(t.untyped_storage(), extra)
        self.tracker.transient(kernel.scratch)
        return out, kernel


@contextmanager
def _tracked_rng_state(tracker: StorageTracker) -> Iterator[None]:
    """torch.utils.checkpoint stashes the CPU RNG state (a real 5 KB tensor, made outside any op)
    for every region that preserves it; count those like any other storage (CPU targets only: on a
    GPU both stashed states are host tensors, profiler/rules/cuda.py)."""
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
        self.session = FakeSession.for_call(self.module, args, kwargs,
                                            device=None if target is None else target.fake_device)
        self.target = target or Target(self.session.device)
        self.scratch = scratch
        self.state = self.session.state(self.module) if self.module is not None else {}
        self.args = self.session.tree(tuple(args))
        self.kwargs = self.session.tree(kwargs or {})
        flat, _ = tree_flatten((self.args, self.kwargs))
        self.inputs = [t for t in flat if isinstance(t, torch.Tensor)]
        self.tracker = StorageTracker(round_bytes=self.target.allocated)
        self.tracker.mark_resident([*self.state.values(), *self.inputs])

    @contextmanager
    def running(self, observer: Observer | None = None) -> Iterator[AccountingMode]:
        mode = AccountingMode(self.tracker, self.target, self.scratch, observer)
        if self.target.device.type == "cuda" and not self.target.stand_in:
            init_cuda_context(self.target.fake_device)
        with ExitStack() as stack:
            stack.enter_context(self.session.mode)
            stack.enter_context(reparametrized(self.module, self.state))
            if self.target.device.type == "cpu":
                stack.enter_context(_tracked_rng_state(self.tracker))
            if self.target.stand_in:
                stack.enter_context(stand_in(self.target.device))
            composites = stack.enter_context(EagerComposites())
            stack.enter_context(mode)
            composites.own_modes()
            yield mode

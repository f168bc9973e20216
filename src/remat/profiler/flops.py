"""Count forward and backward FLOPs of any autograd procedure on fake tensors.

``count_flops(fn, args)`` runs ``fn`` and the backward of its loss (docs/design.md's training step)
under a dispatch mode that applies the formula registry to every aten op.  Nothing real is
allocated: parameters and inputs are fake twins, so batch 4000 of resnet50 counts on a laptop.
"""
from __future__ import annotations

import functools
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import RematWarning
from ..fake import FakeSession, module_of
from ..step import BWD, FWD, LOSS, reparametrized, run_step
from . import formulas_mac, formulas_nn, formulas_pointwise  # noqa: F401  (fill the registry)
from .registry import lookup

__all__ = ["FlopCount", "FlopCounter", "FlopCountingMode", "count_flops"]

@dataclass
class FlopCount:
    """FLOPs of one training step, forward and backward (1 multiply-add = 2 FLOPs)."""

    fwd: int = 0
    bwd: int = 0
    fwd_macs: int = 0  # multiply-adds of matmul/conv/attention ops in the forward
    bwd_macs: int = 0
    fwd_by_op: dict[str, int] = field(default_factory=dict)  # key: overload packet, "aten.convolution"
    bwd_by_op: dict[str, int] = field(default_factory=dict)
    unknown_ops: dict[str, int] = field(default_factory=dict)  # op -> calls, ops with no formula (estimated)

    @property
    def total(self) -> int:
        return self.fwd + self.bwd

    def table(self, top: int = 10) -> str:
        """Totals and the ``top`` most expensive ops, for people."""
        from ..units import fmt_flops

        lines = [f"forward   {fmt_flops(self.fwd):>12}   MACs {fmt_flops(self.fwd_macs)}",
                 f"backward  {fmt_flops(self.bwd):>12}   MACs {fmt_flops(self.bwd_macs)}",
                 f"bwd/fwd   {self.bwd / self.fwd if self.fwd else 0.0:>12.3f}", ""]
        ops = Counter(self.fwd_by_op) + Counter(self.bwd_by_op)
        lines.append(f"{'op':<50}{'forward':>12}{'backward':>12}{'share':>8}")
        for op, total in ops.most_common(top):
            share = total / self.total if self.total else 0.0
            lines.append(f"{op:<50}{fmt_flops(self.fwd_by_op.get(op, 0)):>12}"
                         f"{fmt_flops(self.bwd_by_op.get(op, 0)):>12}{share:>8.1%}")
        if self.unknown_ops:
            lines.append("")
            lines.append("ops without a formula (estimated at 1 FLOP per element): "
                         + ", ".join(f"{k} x{v}" for k, v in sorted(self.unknown_ops.items())))
        return "\n".join(lines)


class FlopCounter:
    """Accumulates per-op FLOPs into the current phase; reusable by other dispatch modes."""

    def __init__(self) -> None:
        self.phase = FWD
        self.by_op: dict[str, defaultdict[str, int]] = {p: defaultdict(int) for p in (FWD, LOSS, BWD)}
        self.macs: dict[str, int] = {FWD: 0, LOSS: 0, BWD: 0}
        self.unknown: Counter[str] = Counter()

    def count(self, func: OpOverload, args: tuple, kwargs: dict, out: Any) -> int:
        """FLOPs of one op call, recorded under the current phase."""
        found = lookup(func)
        if found.formula is None:
            if found.zero:
                return 0
            name = str(func._overloadpacket)
            self.unknown[name] += 1
            _warn_unknown(name)
            flops = unknown_estimate(args, out)
        else:
            flops = int(found.formula.fn(*args, **kwargs, out_val=out))
        self.by_op[self.phase][str(func._overloadpacket)] += flops
        if found.formula is not None and found.formula.mac:
            self.macs[self.phase] += flops // 2
        return flops

    def result(self) -> FlopCount:
        fwd, bwd = dict(self.by_op[FWD]), dict(self.by_op[BWD])
        return FlopCount(sum(fwd.values()), sum(bwd.values()), self.macs[FWD], self.macs[BWD],
                         fwd, bwd, dict(self.unknown))


def unknown_estimate(args: tuple, out: Any) -> int:
    """An op with no formula: one FLOP per element of its largest tensor (never zero)."""
    sizes = [t.numel() for t in torch.utils._pytree.tree_leaves((args, out)) if isinstance(t, torch.Tensor)]
    return max([1, *sizes])


@functools.lru_cache(maxsize=None)
def _warn_unknown(name: str) -> None:
    warnings.warn(f"remat: no FLOP formula for {name}; counting 1 FLOP per element of its largest tensor "
                  "(listed in FlopCount.unknown_ops)", RematWarning, stacklevel=3)


@functools.lru_cache(maxsize=None)
def decomposes(func: OpOverload) -> bool:
    """An op with a CompositeImplicitAutograd kernel is counted through its decomposition."""
    if func is torch.ops.prim.device.default or lookup(func).formula is not None:
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), torch._C.DispatchKey.CompositeImplicitAutograd)


def run_op(mode: TorchDispatchMode, func: OpOverload, args: tuple, kwargs: dict) -> tuple[Any, bool]:
    """Run one op inside ``mode``'s dispatch; a composite op runs as its decomposition under
    ``mode`` (so its parts are seen one by one).  Returns (output, ran_as_is)."""
    if decomposes(func):
        with mode:
            out = func.decompose(*args, **kwargs)
        if out is not NotImplemented:
            return out, False
    return func(*args, **kwargs), True


class FlopCountingMode(TorchDispatchMode):
    """Applies ``counter`` to every op; decomposes composite ops like ``FlopCounterMode`` does."""

    def __init__(self, counter: FlopCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out, as_is = run_op(self, func, args, kwargs)
        if as_is:
            self.counter.count(func, args, kwargs, out)
        return out


def count_flops(fn: Callable[..., Any], args: tuple | list | Any, kwargs: dict | None = None) -> FlopCount:
    """FLOPs of ``fn(*args, **kwargs)`` and of the backward of its loss, on fake tensors.

    ``fn`` may be a module or a bound method of one (its parameters and buffers are replaced by
    fake twins for the call, so the module is never modified); real, meta or fake inputs are all
    accepted.  Tensors captured by other closures count as constants (no gradient).
    """
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    module = module_of(fn)
    session = FakeSession.for_call(module, args, kwargs)
    state = session.state(module) if module is not None else {}
    fargs, fkwargs = session.tree(args), session.tree(kwargs or {})
    counter = FlopCounter()

    def on_phase(name: str, loss: Any) -> None:
        counter.phase = name

    with session.mode, FlopCountingMode(counter), reparametrized(module, state):
        # accumulate=False: the same backward, writing no .grad, so a real tensor that fn captured
        # (a constant to the fake mode) is never touched
        run_step(lambda: fn(*fargs, **fkwargs), on_phase, accumulate=False)
    return counter.result()

"""The rule records and how rule modules register them (the queries are in ``__init__``)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._ops import OpOverload

__all__ = ["RuleContext", "MemoryRule", "RULES", "rule", "scratch_rule", "nbytes"]


@dataclass(frozen=True)
class RuleContext:
    """What a rule may depend on besides the op's arguments: the step's target."""

    device: str  # device type the step runs on: "cpu", "cuda"
    threads: int  # CPU threads the plan assumes (per-thread partials scale with it)


ScratchFn = Callable[[tuple, dict, Any, RuleContext], int]
LayoutFn = Callable[[tuple, Any], Any]
DroppedFn = Callable[[tuple, Any], Any]
HeldFn = Callable[[tuple, RuleContext], int]


@dataclass(frozen=True)
class MemoryRule:
    """One aspect of one op's real memory behaviour on one device type."""

    op: OpOverload | None  # None: every op
    device: str
    doc: str
    source: str
    scratch: ScratchFn | None = None
    layout: LayoutFn | None = None
    dropped: DroppedFn | None = None
    held: HeldFn | None = None
    extra_out: ScratchFn | None = None
    writes: tuple[int, ...] = ()
    workspace: Callable[[RuleContext], int] | None = None  # op None: resident library workspaces
    granularity: int = 0  # op None: allocations on this device are rounded up to a multiple of it
    applies: Callable[[OpOverload], bool] | None = None  # with op None: which ops the rule is about
    value_bound: Callable[[tuple, dict], bool] | None = None  # scratch depends on index values then


RULES: list[MemoryRule] = []


def rule(ops: OpOverload | list[OpOverload] | None, device: str, doc: str, source: str, **aspects: Any) -> None:
    """Register one aspect (``scratch=``, ``extra_out=``, ``layout=``, ``dropped=``, ``held=``, ``writes=``,
    ``workspace=``, ``granularity=``, ``value_bound=``) for ``ops``
    (``None``: a rule about every op, such as how Python-number operands are wrapped)."""
    for op in ops if isinstance(ops, list) else [ops]:
        RULES.append(MemoryRule(op, device, doc, source, **aspects))


def scratch_rule(ops: OpOverload | list[OpOverload] | None, device: str, doc: str, source: str, **aspects: Any):
    """Decorator form of ``rule(..., scratch=fn)``."""

    def deco(fn: ScratchFn) -> ScratchFn:
        rule(ops, device, doc, source, scratch=fn, **aspects)
        return fn

    return deco


def nbytes(t: Any) -> int:
    """Bytes of a tensor's elements (0 for anything else)."""
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

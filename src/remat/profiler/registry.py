"""The FLOP formula registry: one entry per aten overload packet, each with its human formula.

It starts from ``torch.utils.flop_counter.flop_registry`` (matmul, convolution, attention) so that
our counts agree with ``FlopCounterMode`` on the ops it knows, and the other formula modules extend
it.  Every entry carries the text that ``docs/flops.md`` shows, so the docs table is generated from
this registry and cannot drift from the code.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._ops import OpOverload, OpOverloadPacket

__all__ = [
    "Formula",
    "REGISTRY",
    "ZERO_COST",
    "register",
    "register_zero",
    "lookup",
    "numel",
    "first_tensor",
]

aten = torch.ops.aten

FormulaFn = Callable[..., int]


@dataclass(frozen=True)
class Formula:
    """How to count one op: ``fn(*args, out_val=out, **kwargs) -> int`` on the op's raw arguments."""

    fn: FormulaFn
    doc: str
    mac: bool  # a matmul/conv/attention op: its FLOPs are 2 per multiply-add
    group: str  # section of the docs table


REGISTRY: dict[OpOverloadPacket, Formula] = {}
# Ops that move or create data without arithmetic: explicitly 0 FLOPs, and listed in the docs.
ZERO_COST: dict[OpOverloadPacket, str] = {}


def _packets(names: str | list[str]) -> list[OpOverloadPacket]:
    """aten packets for the given names, skipping names this torch build does not have."""
    if isinstance(names, str):
        names = names.split()
    return [getattr(aten, n) for n in names if hasattr(aten, n)]


def register(names: str | list[str], doc: str, *, mac: bool = False, group: str) -> Callable[[FormulaFn], FormulaFn]:
    """Decorator: register ``fn`` as the formula for each named aten op (in-place variants included)."""

    def deco(fn: FormulaFn) -> FormulaFn:
        for packet in _packets(names):
            if packet in REGISTRY:  # as torch's flop_counter: two formulas for one op is a bug
                raise RuntimeError(f"{packet} already has a FLOP formula ({REGISTRY[packet].fn.__name__}); "
                                   f"refusing to register {fn.__name__} over it")
            REGISTRY[packet] = Formula(fn, doc, mac, group)
        return fn

    return deco


def register_zero(names: str | list[str], reason: str) -> None:
    for packet in _packets(names):
        if packet in ZERO_COST or packet in REGISTRY:
            raise RuntimeError(f"{packet} is already registered; refusing to declare it free of cost as well")
        ZERO_COST[packet] = reason


def first_tensor(x: Any) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)):
        for y in x:
            t = first_tensor(y)
            if t is not None:
                return t
    return None


def numel(x: Any) -> int:
    """Elements of a tensor, or of the first tensor of a tuple/list (0 when there is none)."""
    t = first_tensor(x)
    return 0 if t is None else t.numel()


@functools.lru_cache(maxsize=None)
def _is_view_or_metadata(func: OpOverload) -> bool:
    """True when the op returns only aliases of its inputs (views) or no tensors at all (metadata)."""
    schema = func._schema
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return False
    tensor_returns = [r for r in schema.returns if _is_tensor_type(r.type)]
    if not tensor_returns:
        return not any(_is_tensor_type(a.type) for a in schema.arguments) or _is_metadata_query(func)
    return all(r.alias_info is not None and not r.alias_info.is_write for r in tensor_returns)


def _is_tensor_type(t: Any) -> bool:
    text = str(t)
    return text.startswith("Tensor") or text.startswith("Optional[Tensor") or text.startswith("List[Tensor")


# Ops returning no tensor that read only metadata (sizes, strides, devices), never element values.
_METADATA_ONLY = {
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "size", "stride", "numel", "dim",
    "storage_offset", "is_contiguous", "is_strides_like_format", "is_non_overlapping_and_dense",
    "sym_is_contiguous", "is_same_size", "is_complex", "is_floating_point", "_nested_tensor_size",
    "device", "layout", "result_type",
}


def _is_metadata_query(func: OpOverload) -> bool:
    return func._schema.name.split("::")[-1] in _METADATA_ONLY


@dataclass(frozen=True)
class Lookup:
    formula: Formula | None  # None: either zero-cost or unknown
    zero: bool  # True when the op is a view, metadata query or listed data movement


@functools.lru_cache(maxsize=None)
def lookup(func: OpOverload) -> Lookup:
    """Classify one overload: a formula, an explicit zero, or unknown (formula None, zero False)."""
    packet = func._overloadpacket
    formula = REGISTRY.get(packet)
    if formula is not None:
        return Lookup(formula, False)
    if packet in ZERO_COST or func.namespace == "prim" or _is_view_or_metadata(func):
        return Lookup(None, True)
    return Lookup(None, False)

"""Budgets as docs/design.md defines them: bytes, a size string, a fraction of what checkpointing
can save, or ``"min"``.

``budget_bytes = fixed + f * (unconstrained_peak - fixed)`` for a fraction f in (0, 1], where
``fixed`` is the resident bytes plus one gradient per trainable parameter: no schedule goes below it.
``"min"`` is the smallest budget at which the solver returns a verified plan; only the planner can
find it (``planner.search.smallest_budget``), so it resolves there, not here.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .units import parse_bytes

__all__ = ["Budget", "parse_budget"]

_NUMBER = re.compile(r"^\s*[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?\s*$")


@dataclass(frozen=True)
class Budget:
    """An absolute byte count, a fraction, or the smallest feasible budget (``minimum``);
    ``resolve`` turns the first two into bytes."""

    bytes: int | None = None
    fraction: float | None = None
    minimum: bool = False  # budget="min": the planner searches the smallest verified budget

    def resolve(self, fixed: int, unconstrained: int) -> int:
        if self.minimum:
            raise ValueError("budget='min' is resolved by the planner (the smallest verified budget)")
        if self.bytes is not None:
            return self.bytes
        assert self.fraction is not None
        return int(fixed + self.fraction * max(0, unconstrained - fixed))

    def __str__(self) -> str:
        if self.minimum:
            return "min (the smallest feasible budget)"
        return f"{self.bytes} bytes" if self.bytes is not None else f"{self.fraction:g} (fraction)"


def _fraction(value: float, text: object) -> Budget:
    if not math.isfinite(value):
        raise ValueError(f"budget {text!r} is not a finite number")
    if not 0.0 < value <= 1.0:
        raise ValueError(f"budget fraction {text!r} must be in (0, 1]: 1.0 is the unconstrained step, "
                         "0.5 saves half of what checkpointing can save; give bytes as an int or a string like '2GiB'")
    return Budget(fraction=float(value))


def _percent_or_bytes(value: int, text: object) -> None:
    """A bare number from 2 to 100 is far more likely a percentage than a budget of that many bytes
    (no training step fits in 100 bytes): ask instead of planning for it."""
    if 1 < value <= 100:
        raise ValueError(f"budget {text!r} would be {value} bytes: did you mean {value}% ('{value}%', or "
                         f"{value / 100:g})? Write '{value}B' for bytes")


def parse_budget(budget: int | float | str) -> Budget:
    """Parse a user budget; every value that makes no sense is a ValueError saying why."""
    if isinstance(budget, bool) or budget is None:
        raise ValueError(f"budget must be bytes (int), a size string ('1.5GiB', '800MB', '50%'), a fraction "
                         f"in (0, 1] or 'min', got {budget!r}")
    if isinstance(budget, int):
        if budget <= 0:
            raise ValueError(f"budget {budget} bytes must be positive (or a fraction such as 0.5, or 'min')")
        _percent_or_bytes(budget, budget)
        return Budget(bytes=budget)
    if isinstance(budget, float):
        return _fraction(budget, budget)
    if isinstance(budget, str):
        text = budget.strip()
        if text.lower() == "min":
            return Budget(minimum=True)
        if text.endswith("%"):
            try:
                value = float(text[:-1]) / 100.0
            except ValueError:
                raise ValueError(f"cannot parse budget {budget!r}") from None
            return _fraction(value, budget)
        if _NUMBER.match(text) and any(c in text for c in ".eE"):
            return _fraction(float(text), budget)
        if text.lower() in ("nan", "inf", "-inf", "infinity"):
            raise ValueError(f"budget {budget!r} is not a finite number")
        value = parse_bytes(text)
        if text.isdigit():
            _percent_or_bytes(value, budget)
        if value <= 0:
            raise ValueError(f"budget {budget!r} must be positive: bytes, a size ('2GiB'), a fraction ('50%', "
                             "'0.5') or 'min'")
        return Budget(bytes=value)
    raise ValueError(f"budget must be an int, float or str, got {type(budget).__name__}")

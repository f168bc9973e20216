"""Errors remat raises on purpose; anything else escaping a public function is a bug."""
from __future__ import annotations

__all__ = ["RematError", "TraceError", "InfeasibleBudget", "RematWarning"]


class RematWarning(UserWarning):
    """Something remat had to estimate (an op without a formula)."""


class RematError(Exception):
    """Base class of remat's own errors."""


class TraceError(RematError):
    """Neither symbolic_trace nor torch.export could trace the model; the message says where and what to try."""


class InfeasibleBudget(RematError):
    """No checkpointing schedule fits the budget; ``min_bytes`` is the smallest budget that does."""

    def __init__(self, message: str, min_bytes: int | None = None, min_fraction: float | None = None) -> None:
        super().__init__(message)
        self.min_bytes = min_bytes
        self.min_fraction = min_fraction

"""Errors remat raises on purpose; anything else escaping a public function is a bug."""
from __future__ import annotations

__all__ = ["RematError", "TraceError", "InfeasibleBudget", "RematWarning", "ShapeError", "KeptOutputOverwritten",
           "InternalError", "public"]


class RematWarning(UserWarning):
    """Something remat had to estimate (an op without a formula)."""


class RematError(Exception):
    """Base class of remat's own errors."""


class TraceError(RematError):
    """Neither symbolic_trace nor torch.export could trace the model; the message says where and what to try."""


class InfeasibleBudget(RematError):
    """No checkpointing schedule fits the budget; ``min_bytes`` is the smallest budget that does;
    ``bound_bytes`` the least peak any checkpointing of the model's code can reach (below it, no
    plan of any tool fits: another remedy is needed)."""

    def __init__(self, message: str, min_bytes: int | None = None, min_fraction: float | None = None,
                 bound_bytes: int | None = None) -> None:
        super().__init__(message)
        self.min_bytes = min_bytes
        self.min_fraction = min_fraction
        self.bound_bytes = bound_bytes


class ShapeError(RematError, ValueError):
    """A checkpointed module was called with inputs its plan does not cover (a dimension the trace
    fixed, or a different number of dimensions); the message says what was planned."""


class KeptOutputOverwritten(RematError):
    """A checkpoint region keeps an op's output for its recomputation (torch's selective
    checkpointing) and a later op writes into it: recomputing from it would give wrong gradients.
    Raised by the generated module's guard (runtime.py) instead of computing them."""


class InternalError(RematError):
    """A bug in remat itself (never the user's fault); the message says where, to report it."""


_INTERNAL = (AttributeError, KeyError, IndexError, AssertionError, ZeroDivisionError, UnboundLocalError)


def public(fn):
    """Public entry points: an internal exception raised inside remat's own code becomes an
    InternalError that says so, instead of a bare KeyError from deep inside the package."""
    import functools
    import os
    import traceback

    package = os.path.dirname(os.path.abspath(__file__))

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except _INTERNAL as e:
            frames = traceback.extract_tb(e.__traceback__)
            if not frames or not os.path.abspath(frames[-1].filename).startswith(package):
                raise  # raised by the user's model or by torch: theirs to see as is
            where = f"{os.path.relpath(frames[-1].filename, os.path.dirname(package))}:{frames[-1].lineno}"
            raise InternalError(f"remat internal error in {fn.__name__} ({type(e).__name__} at {where}: {e}). "
                                "This is a bug in remat, not in your model; please report it with this message."
                                ) from e

    return wrapper

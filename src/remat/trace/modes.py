"""Grad-mode and autocast regions inside a model's forward, recorded per graph node.

``torch.fx.symbolic_trace`` runs the forward with proxies and records ops only: a ``with
torch.no_grad():`` block in it leaves no trace, and the traced module would build gradients where
the model builds none.  While remat traces, the context managers that set these modes (``no_grad``,
``enable_grad``, ``set_grad_enabled``, ``inference_mode``, ``autocast``) push a ``Mode`` on a stack
when entered and pop it when left; every node created meanwhile gets the stack in
``node.meta["remat_modes"]``.  The generated code enters the same context managers around that
node's statement, and the profile pass runs the node under them, so the module behaves like the
model under any outer mode too (the model's ``no_grad`` inside the user's ``autocast``, say).
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.amp.autocast_mode import autocast
from torch.autograd import grad_mode

__all__ = ["Mode", "GradMode", "InferenceMode", "Autocast", "MODES_KEY", "recording_modes", "current_modes",
           "entered"]

MODES_KEY = "remat_modes"


@dataclass(frozen=True)
class Mode:
    """One context manager around a node: how to enter it now, and how to write it in code."""

    def make(self) -> Any:
        raise NotImplementedError

    def source(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True)
class GradMode(Mode):
    enabled: bool

    def make(self) -> Any:
        return torch.enable_grad() if self.enabled else torch.no_grad()

    def source(self) -> str:
        return "torch.enable_grad()" if self.enabled else "torch.no_grad()"


@dataclass(frozen=True)
class InferenceMode(Mode):
    enabled: bool

    def make(self) -> Any:
        return torch.inference_mode(self.enabled)

    def source(self) -> str:
        return f"torch.inference_mode({self.enabled})"


@dataclass(frozen=True)
class Autocast(Mode):
    device: str
    dtype: torch.dtype
    enabled: bool
    cache: bool

    def make(self) -> Any:
        return torch.autocast(self.device, dtype=self.dtype, enabled=self.enabled, cache_enabled=self.cache)

    def source(self) -> str:
        return (f"torch.autocast({self.device!r}, dtype={self.dtype}, enabled={self.enabled}, "
                f"cache_enabled={self.cache})")


@contextmanager
def entered(modes: tuple[Mode, ...]) -> Iterator[None]:
    """Enter ``modes`` (outermost first)."""
    with ExitStack() as stack:
        for m in modes:
            stack.enter_context(m.make())
        yield


_state = threading.local()


def current_modes() -> tuple[Mode, ...]:
    """The modes a node created now runs under (outermost first); empty outside recording."""
    stack = getattr(_state, "stack", None)
    modes = tuple(m for m, _ in stack) if stack else ()
    # a mode set without a context manager (set_grad_enabled(False) called as a function):
    # record the grad mode as it is
    implied = next((m.enabled for m in reversed(modes) if isinstance(m, GradMode)), True)
    inference = any(isinstance(m, InferenceMode) and m.enabled for m in modes)  # implies no grad
    if stack is not None and not inference and torch.is_grad_enabled() != implied:
        modes = (*modes, GradMode(torch.is_grad_enabled()))
    return modes


def _describe(ctx: Any) -> Mode | None:
    if isinstance(ctx, grad_mode.no_grad):
        return GradMode(False)
    if isinstance(ctx, grad_mode.enable_grad):
        return GradMode(True)
    if isinstance(ctx, grad_mode.set_grad_enabled):
        return GradMode(bool(ctx.mode))
    if isinstance(ctx, grad_mode.inference_mode):
        return InferenceMode(bool(ctx.mode))
    if isinstance(ctx, autocast):
        return Autocast(ctx.device, ctx.fast_dtype, bool(ctx._enabled), bool(ctx._cache_enabled))
    return None


_PATCHED = (grad_mode.no_grad, grad_mode.enable_grad, grad_mode.set_grad_enabled, grad_mode.inference_mode, autocast)


@contextmanager
def recording_modes() -> Iterator[None]:
    """While tracing: keep the stack of entered mode context managers (see the module docstring)."""
    _state.stack = []
    originals = {cls: (cls.__enter__, cls.__exit__) for cls in _PATCHED}

    def patch(cls: type) -> None:
        enter, exit_ = originals[cls]

        def __enter__(self):  # noqa: N807
            result = enter(self)
            mode = _describe(self)
            if mode is not None and getattr(_state, "stack", None) is not None:
                _state.stack.append((mode, id(self)))
            return result

        def __exit__(self, *exc):  # noqa: N807
            stack = getattr(_state, "stack", None)
            if stack and stack[-1][1] == id(self):
                stack.pop()
            return exit_(self, *exc)

        cls.__enter__, cls.__exit__ = __enter__, __exit__

    try:
        for cls in _PATCHED:
            patch(cls)
        yield
    finally:
        for cls, (enter, exit_) in originals.items():
            cls.__enter__, cls.__exit__ = enter, exit_
        _state.stack = None

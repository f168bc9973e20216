"""The model's own ``torch.utils.checkpoint`` calls, recorded as regions instead of run.

Tracing through ``checkpoint(fn, *args)`` records ``fn``'s ops as if the call were not there (and a
reentrant checkpoint's forward runs under ``no_grad``, which torch.export records literally).  While
remat traces, the function both checkpoint variants go through (``torch.utils.checkpoint.
_checkpoint_impl``) is replaced: it calls ``fn`` directly, inside a region whose id every node
created meanwhile carries in ``node.meta["remat_user_region"]`` (the ids of all enclosing regions,
outermost first).  The planner then profiles the model with those regions in place, which is the
step the user runs today (planner/problem.py).
"""
from __future__ import annotations

import itertools
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
import torch.utils.checkpoint as torch_checkpoint

from ..errors import RematWarning

__all__ = ["UserRegion", "REGION_KEY", "capturing_checkpoints", "current_regions"]

REGION_KEY = "remat_user_region"


@dataclass(frozen=True)
class UserRegion:
    """One checkpoint call of the model's forward."""

    id: int
    reentrant: bool
    preserve_rng_state: bool
    custom_context: bool  # the call passed its own context_fn (a selective checkpoint policy, say)


_state = threading.local()


def current_regions() -> tuple[int, ...]:
    return tuple(getattr(_state, "stack", ()) or ())


def _reentrant_without_grad(args: tuple) -> bool:
    """A reentrant checkpoint whose inputs need no gradient gives the parameters inside none."""
    if any(not isinstance(a, torch.Tensor) and type(a).__name__ == "Proxy" for a in args):
        return False  # symbolic tracing: nothing is known yet
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors or any(isinstance(t, torch._subclasses.FakeTensor) for t in tensors):
        return False  # torch.export's fake run: the check's real run says it, once
    return torch.is_grad_enabled() and not any(t.requires_grad for t in tensors)


@contextmanager
def capturing_checkpoints(found: dict[int, UserRegion], annotate: bool = False) -> Iterator[None]:
    """While tracing: checkpoint calls run their function inline, inside a recorded region.

    ``annotate``: also attach the region ids to the nodes through ``torch.fx.traceback.annotate``
    (torch.export's tracer copies them into ``node.meta["custom"]``).  A reentrant call on inputs
    that need no gradient (PyTorch then gives the parameters inside no gradient; inline, they get
    one) is warned about.
    """
    original = torch_checkpoint._checkpoint_impl
    counter = itertools.count(len(found))
    _state.stack = []

    def _checkpoint_impl(function, args, kwargs, *, use_reentrant=None, preserve_rng_state=True,
                         context_fn=torch_checkpoint.noop_context_fn, **_: Any):
        region = UserRegion(next(counter), use_reentrant is not False, bool(preserve_rng_state),
                            context_fn is not torch_checkpoint.noop_context_fn)
        if region.reentrant and _reentrant_without_grad(args):
            warnings.warn("a torch.utils.checkpoint call with use_reentrant=True gets no input that requires grad, so "
                          "PyTorch gives the parameters inside it no gradient; remat's module does give them one (as "
                          "use_reentrant=False would). Pass use_reentrant=False in your model to train them as remat "
                          "does, or freeze them (requires_grad_(False)) to keep them as they are", RematWarning,
                          stacklevel=2)
        found[region.id] = region
        _state.stack.append(region.id)
        try:
            if annotate:
                with fx_traceback.annotate({REGION_KEY: tuple(_state.stack)}):
                    return function(*args, **(kwargs or {}))
            return function(*args, **(kwargs or {}))
        finally:
            _state.stack.pop()

    torch_checkpoint._checkpoint_impl = _checkpoint_impl
    try:
        yield
    finally:
        torch_checkpoint._checkpoint_impl = original
        _state.stack = None

"""What generated modules call at run time; the generated code imports it by this module's name.

Keep these names stable: a module written out with ``remat plan --code`` or pickled refers to them.

* ``freeze_state``: checkpoint keyword arguments that stop recomputation from updating module
  state (BatchNorm running statistics) a second time.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .profiler.rules import hidden_writes

__all__ = ["freeze_state"]


class _FrozenStateMode(TorchDispatchMode):
    """During recomputation: state-writing ops run on copies, in-place updates of state are skipped."""

    def __init__(self, state: set[int]) -> None:
        super().__init__()
        self.state = state  # ids of the buffers' storage objects (unique per storage, fake ones too)

    def _is_state(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and id(t.untyped_storage()) in self.state

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        written = [i for i in hidden_writes(func) if i < len(args) and self._is_state(args[i])]
        if not written:
            return func(*args, **kwargs)
        if written == [0]:
            return args[0]  # e.g. num_batches_tracked.add_(1): already applied in the first forward
        # e.g. BatchNorm's running statistics: let it write into copies
        return func(*(a.clone() if i in written else a for i, a in enumerate(args)), **kwargs)


class _FrozenBatchNorms:
    """During recomputation: BatchNorm modules run with momentum 0 (their statistics keep their
    values: 1 * old + 0 * new) and their batch counters are put back.  No per-op Python dispatch,
    so recomputation runs at full speed."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.norms = [m for m in module.modules()
                      if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats]

    def __enter__(self) -> None:
        self.saved = [(m, m.momentum, None if m.num_batches_tracked is None else m.num_batches_tracked.clone())
                      for m in self.norms]
        for m in self.norms:
            m.momentum = 0.0

    def __exit__(self, *exc: object) -> None:
        with torch.no_grad():
            for m, momentum, count in self.saved:
                m.momentum = momentum
                if count is not None:
                    m.num_batches_tracked.copy_(count)


def freeze_state(module: torch.nn.Module, ops: bool = False) -> dict[str, Any]:
    """Keyword arguments for checkpoint: a ``context_fn`` that recomputes without updating
    ``module``'s buffers again.

    ``ops=False``: the state writers are BatchNorm modules (symbolic traces), frozen module by
    module; ``ops=True``: they are aten ops in the graph (torch.export), frozen by a dispatch mode.
    Under torch.compile there is nothing to freeze (AOTAutograd applies buffer mutations once, in
    the forward graph, and recomputes only values) and dynamo accepts no other ``context_fn``.
    """
    if torch.compiler.is_compiling():
        return {}

    def context_fn():
        if not ops:
            return contextlib.nullcontext(), _FrozenBatchNorms(module)
        state = {id(b.untyped_storage()) for b in module.buffers()}
        return contextlib.nullcontext(), _FrozenStateMode(state)

    return {"context_fn": context_fn}

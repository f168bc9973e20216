"""The symbolic_trace frontend: readable graphs with the model's own module calls and names.

``symbolic_trace`` keeps ``torch.nn`` modules as ``call_module`` nodes, which gives readable
generated code and the original parameter names for free.  remat's tracer also records, per node,
the grad/autocast modes it runs under (``modes.py``) and the model's own checkpoint regions it
belongs to (``capture.py``); buffers read as ``self.x`` become named ``get_attr`` nodes.
"""
from __future__ import annotations

import inspect
import operator
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import fx

from ..errors import RematWarning
from .capture import REGION_KEY, UserRegion, capturing_checkpoints, current_regions
from .modes import MODES_KEY, current_modes, recording_modes

__all__ = ["symbolic", "hooked"]


class _Tracer(fx.Tracer):
    """symbolic_trace's tracer, plus per-node modes and checkpoint regions.

    Buffers read through ``self.x`` become get_attr nodes with their own names (by default a buffer
    used as ``self.buf.view(-1)`` is baked in as an anonymous ``_tensor_constantN``, and the traced
    module's state_dict keys would differ from the model's)."""

    proxy_buffer_attributes = True

    def __init__(self) -> None:
        super().__init__()
        self.hooked: list[str] = []  # modules kept whole because they have hooks

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        """Modules with forward or backward hooks stay calls: traced through, a hook's tensor ops
        would be inlined and its Python side effects (recording features, logging) would run only
        while tracing; called, the hooks run at every step, as in the model."""
        if module_qualified_name and hooked(m):
            if module_qualified_name not in self.hooked:
                self.hooked.append(module_qualified_name)
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def create_node(self, kind: str, target: Any, args: Any, kwargs: Any, name: str | None = None,
                    type_expr: Any = None) -> fx.Node:
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        if kind not in ("placeholder", "output", "get_attr"):
            modes = current_modes()
            if modes:
                node.meta[MODES_KEY] = modes
            regions = current_regions()
            if regions:
                node.meta[REGION_KEY] = regions
        return node


def hooked(module: torch.nn.Module) -> bool:
    """Has ``module`` forward or backward hooks of its own?"""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)


def _leaf_wrapper(module: torch.nn.Module) -> torch.nn.Module:
    """A model that is itself one of torch's leaf modules (a bare BatchNorm2d, say), wrapped so it is
    traced as a call to it, as it would be inside a model (its forward may read buffer values, which
    tracing cannot).  The wrapper's forward has the same parameters (fx reads them off the code);
    the module's parameters are named ``module.*`` in the trace."""
    params = list(inspect.signature(module.forward).parameters.values())
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        return module  # nothing to mirror: trace it as it is
    names = [p.name for p in params]
    defaults = {p.name: p.default for p in params if p.default is not p.empty}
    header = ", ".join(f"{n}=_defaults[{n!r}]" if n in defaults else n for n in names)
    namespace: dict[str, Any] = {"_defaults": defaults}
    exec(f"def forward(self, {header}):\n    return self.module({', '.join(names)})\n", namespace)
    wrapper = type("Leaf", (torch.nn.Module,), {"forward": namespace["forward"]})()
    wrapper.module = module
    return wrapper


_INPLACE = {"__iadd__": operator.iadd, "__isub__": operator.isub, "__imul__": operator.imul,
            "__itruediv__": operator.itruediv}


@contextmanager
def _inplace_operators() -> Iterator[None]:
    """``out += identity`` stays in place.  fx's Proxy has no ``__iadd__``, so Python records an
    out-of-place ``out + identity`` (a new output-sized tensor per residual block, which made traced
    ResNets 4-6 % slower than eager on the CPU); while remat traces, these operators record
    ``operator.iadd`` & co., which run the tensor's own in-place method, as the model does."""
    added = [name for name in _INPLACE if name not in vars(fx.Proxy)]

    def recorder(op: Any):
        def method(self: fx.Proxy, other: Any) -> fx.Proxy:
            return self.tracer.create_proxy("call_function", op, (self, other), {})
        return method

    for name in added:
        setattr(fx.Proxy, name, recorder(_INPLACE[name]))
    try:
        yield
    finally:
        for name in added:
            delattr(fx.Proxy, name)


def symbolic(model: torch.nn.Module) -> fx.GraphModule:
    """Trace ``model`` with symbolic_trace (see the module docstring)."""
    tracer = _Tracer()
    regions: dict[int, UserRegion] = {}
    if tracer.is_leaf_module(model, ""):
        model = _leaf_wrapper(model)
    with torch.enable_grad(), recording_modes(), capturing_checkpoints(regions), _inplace_operators():
        graph = tracer.trace(model)
    gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    if tracer.hooked:
        warnings.warn(f"remat: {', '.join(tracer.hooked[:3])}{' and others' if len(tracer.hooked) > 3 else ''} "
                      f"{'has' if len(tracer.hooked) == 1 else 'have'} hooks: kept as whole calls, so the hooks run at every step; they run again "
                      "when a checkpoint recomputes the module (as under torch.utils.checkpoint)",
                      RematWarning, stacklevel=3)
    gm.remat_frontend = "symbolic_trace"
    gm.remat_user_regions = regions
    return gm

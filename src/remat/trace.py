"""Trace a model into a torch.fx GraphModule: symbolic_trace first, torch.export as the fallback.

``symbolic_trace`` keeps ``torch.nn`` modules as ``call_module`` nodes, which gives readable
generated code and the original parameter names for free.  Models with data-dependent Python
control flow (HF transformers among them) fail there and go through
``torch.export.export(strict=False).module()``, which runs the model on fake tensors and also keeps
the original parameter and buffer names.  ``gm.remat_frontend`` records which one was used.
"""
from __future__ import annotations

import traceback
import warnings
from typing import Any

import torch
from torch import fx

from .errors import TraceError
from .fake import FakeSession, module_of

__all__ = ["trace", "FRONTENDS"]

FRONTENDS = ("symbolic_trace", "export")


class _Tracer(fx.Tracer):
    """symbolic_trace's tracer, but buffers read through ``self.x`` become get_attr nodes with
    their own names (by default a buffer used as ``self.buf.view(-1)`` is baked in as an anonymous
    ``_tensor_constantN``, and the traced module's state_dict keys would differ from the model's)."""

    proxy_buffer_attributes = True


def _symbolic(model: torch.nn.Module) -> fx.GraphModule:
    tracer = _Tracer()
    graph = tracer.trace(model)
    gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    gm.remat_frontend = "symbolic_trace"
    return gm


def _export(model: torch.nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule:
    session = FakeSession.for_call(model, args, kwargs)
    meta = any(isinstance(t, torch.Tensor) and t.device.type == "meta"
               for t in torch.utils._pytree.tree_leaves((args, kwargs)))
    if meta:  # export needs inputs on the model's device; fake twins carry no data either way
        args, kwargs = session.tree(args), session.tree(kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.export.export(model, args, kwargs, strict=False)
    gm = program.module()
    gm.remat_frontend = "export"
    return gm


def _where(exc: BaseException) -> str:
    """The innermost frame of user code (not torch) in a traceback, for the error message."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/torch/" not in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    return f"{f.filename}:{f.lineno}: {f.line}"


def trace(model: torch.nn.Module, example_inputs: Any = (), kwargs: dict | None = None) -> fx.GraphModule:
    """Trace ``model`` into a GraphModule that shares its parameters and keeps their names."""
    if module_of(model) is None:
        raise TypeError(f"remat traces torch.nn.Module instances, got {type(model).__name__}")
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    kwargs = kwargs or {}
    try:
        return _symbolic(model)
    except Exception as first:  # noqa: BLE001 - any tracing failure falls back to export
        symbolic_error = first
    try:
        return _export(model, args, kwargs)
    except Exception as second:  # noqa: BLE001
        hint = ("mark the submodule that breaks tracing as a leaf, pass `shared_inputs` for inputs used "
                "everywhere (attention masks), or turn off caches (`config.use_cache = False`)")
        if "use_cache" in str(second) or "past_key_values" in str(second) or "DynamicCache" in str(second):
            hint = "turn off the KV cache: model.config.use_cache = False"
        raise TraceError(
            f"could not trace {type(model).__name__}.\n"
            f"  symbolic_trace failed at {_where(symbolic_error) or '?'}: "
            f"{type(symbolic_error).__name__}: {symbolic_error}\n"
            f"  torch.export failed at {_where(second) or '?'}: {type(second).__name__}: {second}\n"
            f"  Try: {hint}."
        ) from second

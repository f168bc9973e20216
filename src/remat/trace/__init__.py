"""Trace a model into a torch.fx GraphModule that trains like it, or say why not.

Frontends in order: ``symbolic_trace`` (readable code, the model's own module calls; symbolic.py),
then ``torch.export`` (follows data-dependent Python; export.py).  Each records the model's grad and
autocast regions and its own checkpoint calls.  The first trace that passes the trace check
(check.py: one step of each on the same inputs, outputs, gradients and buffers compared) is
returned; ``gm.remat_frontend`` says which.  A symbolic trace that keeps torch.nn modules made of
several layers as single calls (nn.TransformerEncoder: fx does not trace into torch.nn) is kept only
if torch.export fails: nothing inside such a call could be checkpointed apart.  When none agrees, ``TraceError`` names the first
difference of each, or where each failed to trace.
"""
from __future__ import annotations

import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import fx

from .. import progress
from ..errors import RematError, RematWarning, TraceError
from ..fake import module_of
from .body import with_modes
from .check import Mismatch, check_trace
from .export import export
from .modes import MODES_KEY
from .symbolic import hooked, symbolic

__all__ = ["trace", "FRONTENDS"]

def _symbolic(model: torch.nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule:
    gm = symbolic(model)
    if any(MODES_KEY in n.meta for n in gm.graph.nodes):
        gm = with_modes(gm, MODES_KEY)  # the generated code enters the recorded modes
    return gm


FRONTENDS: dict[str, Callable[[torch.nn.Module, tuple, dict], fx.GraphModule]] = {
    "symbolic_trace": _symbolic,
    "export": export,
}
_SHOWN = {"export": "torch.export"}


def _where(exc: BaseException) -> str:
    """The innermost frame of user code (not torch) in a traceback, for the error message."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/torch/" not in f.filename
              and "/remat/" not in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    return f"{f.filename}:{f.lineno}: {f.line}"


def _hint(failures: dict[str, BaseException | Mismatch]) -> str:
    text = " ".join(str(e) for e in failures.values())
    if "use_cache" in text or "past_key_values" in text or "DynamicCache" in text:
        return "turn off the KV cache: model.config.use_cache = False"
    if any(isinstance(e, Mismatch) for e in failures.values()):
        return ("the traced module computes something else than the model (a Python side effect, state "
                "kept between calls, or random numbers drawn outside torch); mark the submodule responsible "
                "as a leaf, or pass check=False if you know the difference does not matter")
    return ("mark the submodule that breaks tracing as a leaf, pass `shared_inputs` for inputs used "
            "everywhere (attention masks), or turn off caches (`config.use_cache = False`)")


def _constants_as_buffers(gm: fx.GraphModule) -> None:
    """Register the tensors the graph reads that are neither parameters nor buffers (a tensor
    ``torch.export`` lifted from a closure, an attention mask) as buffers, as ``fx.GraphModule``
    does when it builds every generated module: the profile then counts them resident, as a real
    step of the generated module holds them (not persistent: ``_state_dict_of``)."""
    state = {id(t) for t in [*gm.parameters(), *gm.buffers()]}
    for node in gm.graph.find_nodes(op="get_attr"):
        owner_name, _, field = node.target.rpartition(".")
        owner = gm.get_submodule(owner_name) if owner_name else gm
        value = getattr(owner, field, None)
        if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter) and id(value) not in state:
            delattr(owner, field)
            owner.register_buffer(field, value)
            state.add(id(value))


def _state_dict_of(model: torch.nn.Module, gm: fx.GraphModule) -> None:
    """Buffers the trace has and the model does not (a plain tensor attribute fx copied in, a
    constant torch.export lifted) are not persistent: ``gm.state_dict()`` has the model's keys."""
    theirs = {id(b) for b in model.buffers()}
    for name, buffer in list(gm.named_buffers(remove_duplicate=False)):
        if id(buffer) not in theirs:
            owner_name, _, field = name.rpartition(".")
            (gm.get_submodule(owner_name) if owner_name else gm)._non_persistent_buffers_set.add(field)


def _compiled(model: Any) -> bool:
    """Is ``model`` torch.compile's wrapper?  (Only if dynamo was imported: no import cost otherwise.)"""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(model, eval_frame.OptimizedModule)


def _inlined_hooks(model: torch.nn.Module) -> None:
    """torch.export traces through module hooks: their tensor ops are in the graph, their Python
    side effects happened once, while tracing (symbolic_trace keeps hooked modules as calls)."""
    names = [n for n, m in model.named_modules() if n and hooked(m)]
    if names:
        warnings.warn(f"remat: torch.export traced through the hooks of {', '.join(names[:3])}"
                      f"{' and others' if len(names) > 3 else ''}: what they compute is in the trace, but "
                      "Python side effects (recording outputs, logging) will not happen in training",
                      RematWarning, stacklevel=3)


def _layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """Child modules with parameters, looking through containers (ModuleList, Sequential)."""
    out = []
    for child in module.children():
        if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)):
            out += _layers(child)
        elif any(True for _ in child.parameters()):
            out.append(child)
    return out


def _opaque_calls(gm: fx.GraphModule) -> list[str]:
    """Calls symbolic_trace kept whole that hold several layers (nn.TransformerEncoder, its layers,
    nn.Transformer: torch.nn modules fx does not trace into, with more than one submodule that has
    parameters).  Nothing inside one call can be checkpointed apart, so a model built from them
    would get no plan below its peak; torch.export traces inside."""
    out = []
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        module = gm.get_submodule(node.target)
        if hooked(module):
            continue  # kept whole on purpose (symbolic.py)
        if len(_layers(module)) > 1:
            out.append(str(node.target))
    return out


@contextmanager
def _without_kv_cache(model: torch.nn.Module, kwargs: dict) -> Iterator[None]:
    """A Hugging Face model in training mode with ``config.use_cache`` on (the default of most
    configs) returns a KV cache object no trace can follow, and no training step reads: it is
    traced with the cache off, and the config put back after (``generate`` still uses it).  A
    call that passes ``use_cache=True`` itself keeps it."""
    config = getattr(model, "config", None)
    if not model.training or getattr(config, "use_cache", None) is not True or "use_cache" in kwargs:
        yield
        return
    progress.log.debug("tracing with config.use_cache = False: a training step keeps no KV cache")
    config.use_cache = False
    try:
        yield
    finally:
        config.use_cache = True


def trace(model: torch.nn.Module, example_inputs: Any = (), kwargs: dict | None = None, *,
          check: bool = True) -> fx.GraphModule:
    """Trace ``model`` into a GraphModule that shares its parameters and keeps their names, and
    (``check=True``) trains like it on ``example_inputs``.  A Hugging Face model's KV cache is
    off while it is traced (``_without_kv_cache``)."""
    if module_of(model) is None:
        raise TypeError(f"remat traces torch.nn.Module instances, got {type(model).__name__}")
    kwargs = kwargs or {}
    with _without_kv_cache(model, kwargs):
        return _trace(model, example_inputs, kwargs, check)


def _trace(model: torch.nn.Module, example_inputs: Any, kwargs: dict, check: bool) -> fx.GraphModule:
    if _compiled(model):
        raise RematError("remat plans the model itself, not its torch.compile wrapper: pass the module you "
                         "compiled (model._orig_mod) and compile what remat returns, "
                         "torch.compile(remat.checkpoint(model, inputs, budget=...))")
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    failures: dict[str, BaseException | Mismatch] = {}
    fallback: fx.GraphModule | None = None
    for name, frontend in FRONTENDS.items():
        try:
            gm = frontend(model, args, kwargs)
        except Exception as e:  # noqa: BLE001 - any tracing failure moves on to the next frontend
            failures[name] = e
            continue
        _constants_as_buffers(gm)
        _state_dict_of(model, gm)
        mismatch = check_trace(model, gm, args, kwargs) if check else None
        if mismatch is None:
            opaque = _opaque_calls(gm) if name == "symbolic_trace" and fallback is None else []
            if opaque:  # try the next frontend, which can cut inside them; keep this trace if it fails
                fallback = gm
                progress.log.debug(f"symbolic_trace keeps {', '.join(opaque[:3])} whole: trying the next frontend")
                continue
            if name != "symbolic_trace":
                _inlined_hooks(model)
            return gm
        failures[name] = mismatch
    if fallback is not None:
        return fallback
    lines = [f"could not trace {type(model).__name__} into a module that trains like it."]
    for name, failure in failures.items():
        if isinstance(failure, Mismatch):
            lines.append(f"  {_SHOWN.get(name, name)} traced, but the trace check found a difference: {failure}")
        else:
            where = _where(failure) or "?"
            lines.append(f"  {_SHOWN.get(name, name)} failed at {where}: {type(failure).__name__}: {failure}")
    lines.append(f"  Try: {_hint(failures)}.")
    raise TraceError("\n".join(lines)) from next((f for f in failures.values() if isinstance(f, BaseException)), None)

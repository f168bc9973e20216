"""The torch.export frontend, for models symbolic_trace cannot follow (data-dependent Python).

``torch.export.export(strict=False)`` runs the model on fake tensors and also keeps the original
parameter and buffer names.  It records ``no_grad`` and ``autocast`` blocks itself (as
``wrap_with_set_grad_enabled`` / ``wrap_with_autocast`` calls); ``inference_mode`` blocks are
traced as ``no_grad`` (the same gradients; inference tensors only add restrictions), and the
model's own checkpoint calls become recorded regions (``capture.py``).

Every dimension of every tensor input is exported as ``Dim.AUTO``: export keeps a dimension
dynamic unless the model's code pins it, so the module accepts other batch sizes and sequence
lengths; the placeholders' recorded shapes say which stayed dynamic (inputs.py: the shape
contract, ``runtime.check_inputs``).
"""
from __future__ import annotations

import operator

import inspect
import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.fx._pytree as fx_pytree
import torch.fx.traceback as fx_traceback
from torch import fx
from torch.autograd import grad_mode
from torch.export import Dim
from torch.utils._pytree import tree_map

from ..fake import FakeSession
from ..step import reparametrized
from .capture import REGION_KEY, UserRegion, capturing_checkpoints

__all__ = ["export"]


@contextmanager
def _inference_mode_as_no_grad() -> Iterator[None]:
    cls = grad_mode.inference_mode
    enter, exit_ = cls.__enter__, cls.__exit__

    def __enter__(self):  # noqa: N807
        self._remat_prev = torch.is_grad_enabled()
        torch._C._set_grad_enabled(self._remat_prev and not self.mode)

    def __exit__(self, *exc):  # noqa: N807
        torch._C._set_grad_enabled(self._remat_prev)

    cls.__enter__, cls.__exit__ = __enter__, __exit__
    try:
        yield
    finally:
        cls.__enter__, cls.__exit__ = enter, exit_


def _dynamic_shapes(model: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    """``Dim.AUTO`` for every dimension of every tensor input, by forward parameter name."""
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None

    def spec(x: Any) -> Any:
        return {d: Dim.AUTO for d in range(x.dim())} if isinstance(x, torch.Tensor) and x.dim() else None

    return {name: tree_map(spec, value) for name, value in bound.arguments.items()}


@contextmanager
def _quiet_loggers(*names: str) -> Iterator[None]:
    """Export logs what it decides about each Dim.AUTO dimension (``0/1 specialized``, ...): our
    choice, not the user's concern."""
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _export(model: torch.nn.Module, args: tuple, kwargs: dict, dynamic: Any) -> Any:
    with warnings.catch_warnings(), _quiet_loggers("torch._export", "torch.export", "torch.fx.experimental.symbolic_shapes"):
        warnings.simplefilter("ignore")
        return torch.export.export(model, args, kwargs, strict=False, dynamic_shapes=dynamic)


def _follow_training_flag(gm: fx.GraphModule, mode: bool) -> None:
    """Make the ops' ``train``/``training`` arguments read ``self.training`` again.

    Export evaluates ``training=self.training`` to a constant, so ``eval()`` on the module would keep
    dropout on and batch statistics in use.  Every aten op whose schema has a bool argument of that
    name, set to the mode the model was traced in, reads the root module's flag instead, and a
    nonzero attention ``dropout_p`` traced in training becomes ``p * self.training`` (models pass
    ``dropout_p if self.training else 0.0``).  A model that passes a literal ``training=True`` or a
    dropout rate in eval in its own code is the exception this cannot see.
    """
    flag: fx.Node | None = None
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        for i, arg in enumerate(node.target._schema.arguments):
            flag_arg = arg.name in ("train", "training") and str(arg.type) == "bool"
            rate_arg = arg.name == "dropout_p" and mode  # attention's dropout, given only in training
            if not (flag_arg or rate_arg):
                continue
            where = "args" if i < len(node.args) else ("kwargs" if arg.name in node.kwargs else None)
            value = node.args[i] if where == "args" else node.kwargs.get(arg.name) if where else None
            if where is None or (flag_arg and value is not mode) or (rate_arg and not isinstance(value, float)) \
                    or value == 0.0:
                continue
            if flag is None:
                first = next(n for n in gm.graph.nodes if n.op != "placeholder")
                with gm.graph.inserting_before(first):
                    flag = gm.graph.create_node("get_attr", "training")  # a bool, not a tensor: no reference check
            new = flag
            if rate_arg:  # p while training, 0.0 in eval
                with gm.graph.inserting_before(node):
                    new = gm.graph.call_function(operator.mul, (flag, value))
            if where == "args":
                node.args = (*node.args[:i], new, *node.args[i + 1:])
            else:
                node.kwargs = {**node.kwargs, arg.name: new}
    if flag is not None:
        gm.recompile()


def _module(program: Any, args: tuple, kwargs: dict) -> fx.GraphModule:
    """The exported program as a module, with its input guards when they run.

    torch.export writes the guards of dynamic dimensions as Python source; for a forward taking
    ``*args, **kwargs`` (PEFT's models) that source names an undefined ``L`` and every call fails
    with a NameError.  Such a module is rebuilt without the guard function: its dimensions stay
    dynamic, and remat's own shape contract (runtime.check_inputs) checks the inputs."""
    gm = program.module()
    guards = getattr(gm, "_guards_fn", None)
    if guards is None:
        return gm
    try:
        guards(*fx_pytree.tree_flatten_spec((args, kwargs), gm._in_spec))
    except Exception:  # noqa: BLE001 - torch's generated guard source, not the model
        gm = program.module(check_guards=False)
    return gm


def _fake_state(model: torch.nn.Module, session: FakeSession) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers as fakes on the session's device, parameters still
    ``nn.Parameter``s (export checks) and tied ones still one object."""
    params = {id(p) for p in model.parameters()}
    wrapped: dict[int, torch.Tensor] = {}
    state = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        fake = session.tensor(t)
        if id(t) in params:
            fake = wrapped.setdefault(id(fake), torch.nn.Parameter(fake, requires_grad=t.requires_grad))
        state[name] = fake
    return state


def _share_state(model: torch.nn.Module, gm: fx.GraphModule) -> None:
    """Point ``gm``'s parameters and buffers (fakes while exporting) at the model's own tensors."""
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        owner_name, _, field = name.rpartition(".")
        try:
            owner = gm.get_submodule(owner_name) if owner_name else gm
        except AttributeError:
            continue  # not used by the graph
        if field in owner._parameters:
            owner._parameters[field] = t
        elif field in owner._buffers:
            owner._buffers[field] = t


def export(model: torch.nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule:
    """Trace ``model`` with torch.export (see the module docstring)."""
    session = FakeSession.for_call(model, args, kwargs)
    state_on_meta = any(t.device.type == "meta" for t in (*model.parameters(), *model.buffers()))
    meta = state_on_meta or any(isinstance(t, torch.Tensor) and t.device.type == "meta"
                                for t in torch.utils._pytree.tree_leaves((args, kwargs)))
    if meta:  # export needs inputs on the model's device; fake twins carry no data either way
        args, kwargs = session.tree(args), session.tree(kwargs)
    # A model built on the meta device (``with torch.device("meta")``, accelerate's
    # ``init_empty_weights``) is exported with its state faked on the device the step runs on:
    # on meta, its code would make tensors on meta (``device=self.weight.device``) and kernels
    # would give other strides, so the graph would not be the materialized model's (a plan made on
    # meta is applied to it by tracing it again: the stages must be the same).
    swapped = reparametrized(model, _fake_state(model, session)) if state_on_meta else nullcontext()
    regions: dict[int, UserRegion] = {}
    with fx_traceback.preserve_node_meta(), capturing_checkpoints(regions, annotate=True), \
            _inference_mode_as_no_grad(), swapped:
        dynamic = _dynamic_shapes(model, args, kwargs)
        try:
            program = _export(model, args, kwargs, dynamic)
        except Exception:  # noqa: BLE001 - a model whose shapes export cannot keep dynamic
            if dynamic is None:
                raise
            regions.clear()
            program = _export(model, args, kwargs, None)
    gm = _module(program, args, kwargs)
    if state_on_meta:
        _share_state(model, gm)
    _follow_training_flag(gm, model.training)
    for node in gm.graph.nodes:
        custom = node.meta.get("custom") or {}
        if REGION_KEY in custom:
            node.meta[REGION_KEY] = tuple(custom[REGION_KEY])
    gm.remat_frontend = "export"
    gm.remat_user_regions = regions
    return gm

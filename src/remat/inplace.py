"""Checkpointing that keeps the user's module object (``remat.checkpoint_`` / ``remat.restore_``).

``attach(model, gm, args, kwargs)`` replaces ``forward`` on the model instance (not its class) by
one that runs the generated module ``gm`` (which shares the model's parameters and buffers) for
the calls the plan covers, and the model's original forward for every other call.  The planned
code runs when all of these hold:

1. autograd is recording (``torch.is_grad_enabled()``): a forward under ``no_grad`` or
   ``inference_mode`` (``generate``, evaluation loops) keeps no activations, so there is nothing
   to checkpoint;
2. ``model.training`` is what it was when the plan was made (``eval()`` runs the original forward);
3. the call passes the same arguments as the planned call, by name (positionally or as keywords:
   an argument passed with its default value counts as not passed), and non-tensor arguments have
   the values they had (``use_cache=True``, ``past_key_values=...``, a new keyword: the original);
4. the tensors fit the plan's shape contract (a dimension the trace pinned that differs: the
   original forward, with a warning; a larger batch or sequence runs planned, with a warning that
   the budget no longer holds, as for any generated module).

Nothing is registered on the model: ``state_dict``, ``parameters()``, ``save_pretrained``, ``config``
and ``generate`` see the model as it was.  ``detach(model)`` puts the original forward back.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from .contract import warn_once
from .errors import ShapeError

__all__ = ["attach", "attach_pending", "detach", "is_attached"]

_KEY = "_remat_inplace"


class _Missing:
    """No value (one of its kind, and it stays so through deepcopy and pickle)."""

    def __reduce__(self) -> str:
        return "_MISSING"


_MISSING = _Missing()
_PLAIN = (bool, int, float, str, bytes, type(None))


def _has_tensor(value: Any) -> bool:
    return any(isinstance(t, torch.Tensor) for t in tree_leaves(value))


def _is_default(value: Any, default: Any) -> bool:
    if default is inspect.Parameter.empty:
        return False
    return value is default or (type(value) is type(default) and isinstance(value, _PLAIN) and value == default)


def _same_constant(a: Any, b: Any) -> bool:
    return a is b or (type(a) is type(b) and isinstance(a, (*_PLAIN, tuple)) and a == b)


@dataclass
class _Call:
    """A call bound to the forward's signature: every argument by name (defaults applied), and
    which of them were passed (not as their default)."""

    values: dict[str, Any]
    passed: frozenset[str]

    @classmethod
    def bind(cls, signature: inspect.Signature, args: tuple, kwargs: dict) -> "_Call | None":
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return None
        passed = set()
        for name, value in bound.arguments.items():
            param = signature.parameters[name]
            if param.kind is param.VAR_POSITIONAL and value:
                return None  # *args: not something a plan can name
            if param.kind is param.VAR_KEYWORD:
                passed.update(value)
            elif not _is_default(value, param.default):
                passed.add(name)
        bound.apply_defaults()
        values = dict(bound.arguments)
        for param in signature.parameters.values():
            if param.kind is param.VAR_KEYWORD:
                values.update(values.pop(param.name, {}))
            elif param.kind is param.VAR_POSITIONAL:
                values.pop(param.name, None)
        return cls(values, frozenset(passed))


@dataclass
class InPlace:
    """What ``attach`` keeps on the model (``model.__dict__["_remat_inplace"]``)."""

    module: torch.nn.Module  # the generated module
    original: Callable[..., Any]  # the model's forward before
    saved: Any  # the instance's own ``forward`` attribute before, or _MISSING
    signature: inspect.Signature
    positional: tuple[str, ...]  # the planned call: arguments passed positionally, in order
    keywords: tuple[str, ...]  # ... and by keyword
    passed: frozenset[str]
    constants: dict[str, Any]  # non-tensor arguments of the planned call
    training: bool

    def covers(self, model: torch.nn.Module, call: _Call | None) -> str | None:
        """Why the planned code does not cover this call (None: it does)."""
        if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            return "no_grad"
        if model.training != self.training:
            return f"the model is in {'training' if model.training else 'eval'} mode, planned in the other"
        if call is None or call.passed != self.passed:
            got = "?" if call is None else ", ".join(sorted(call.passed))
            return f"it passes ({got}) where the plan was made for ({', '.join(sorted(self.passed))})"
        for name, value in self.constants.items():
            if not _same_constant(call.values.get(name, _MISSING), value):
                return f"{name}={call.values.get(name)!r} where the plan was made with {value!r}"
        return None

    def run(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        call = _Call.bind(self.signature, args, kwargs)
        why = self.covers(model, call)
        if why is not None:
            if why != "no_grad" and model.training:
                warn_once(model, why, f"remat: this call runs {type(model).__name__}'s original forward, without "
                          f"checkpointing: {why}. Plan with the call you train with (remat.checkpoint_).", stacklevel=4)
            return self.original(*args, **kwargs)
        assert call is not None
        try:
            return self.module(*(call.values[n] for n in self.positional),
                               **{n: call.values[n] for n in self.keywords})
        except ShapeError as e:  # raised by the input check, before anything ran
            warn_once(model, f"shape:{e}", f"remat: this call runs the original forward, without checkpointing: {e}",
                      stacklevel=4)
            return self.original(*args, **kwargs)


@dataclass
class Pending:
    """A plan to be made at the model's first training call (``checkpoint_`` without example
    inputs): whatever calls the model (Hugging Face's Trainer with its batch keys and
    ``num_items_in_batch``, accelerate, a loop of the user's) shows remat the call to plan for."""

    make: Callable[[torch.nn.Module, tuple, dict], torch.nn.Module]  # plans a model for a call
    original: Callable[..., Any]
    saved: Any
    signature: inspect.Signature

    def run(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        if not model.training or not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            return self.original(*args, **kwargs)
        # a wrapper put on the forward after checkpoint_ (accelerate's autocast, which calls our
        # _Forward) stays: it is what the next calls go through
        wrapper = model.__dict__.get("forward", _MISSING)
        _restore(model, self.saved)  # planning traces the model's own forward
        model.__dict__.pop(_KEY, None)
        try:
            gm = self.make(model, args, kwargs)  # (the model called: a copy plans itself)
        except BaseException:
            _install(model, self, self.saved)  # the next call tries again
            _keep_wrapper(model, wrapper)
            raise
        attach(model, gm, args, kwargs, saved=self.saved)
        _keep_wrapper(model, wrapper)
        return model.__dict__[_KEY].run(model, args, kwargs)


def _keep_wrapper(model: torch.nn.Module, wrapper: Any) -> None:
    if wrapper is not _MISSING and not isinstance(wrapper, _Forward):
        model.__dict__["forward"] = wrapper


def _restore(model: torch.nn.Module, saved: Any) -> None:
    if saved is _MISSING:
        model.__dict__.pop("forward", None)
    else:
        model.__dict__["forward"] = saved


def _install(model: torch.nn.Module, state: "InPlace | Pending", saved: Any) -> None:
    model.__dict__[_KEY] = state
    model.__dict__["forward"] = _Forward(model)


def attach_pending(model: torch.nn.Module,
                   make: Callable[[torch.nn.Module, tuple, dict], torch.nn.Module]) -> torch.nn.Module:
    """Plan at the model's first training call (see ``Pending``); returns ``model``."""
    if is_attached(model):
        detach(model)
    original = model.forward
    saved = model.__dict__.get("forward", _MISSING)
    _install(model, Pending(make, original, saved, inspect.signature(original)), saved)
    return model


class _Forward:
    """The forward ``attach`` puts on the model instance: it runs the plan or the original
    (``InPlace.run``) and has the original's signature, because training code reads it: Hugging
    Face's ``Trainer`` keeps only the batch keys ``inspect.signature(model.forward)`` names (with a
    bare ``(*args, **kwargs)`` it dropped ``input_ids``), PEFT and accelerate inspect it too."""

    __name__ = "forward"

    def __init__(self, model: torch.nn.Module) -> None:
        self.__self__ = model

    @property
    def __signature__(self) -> inspect.Signature:
        return self.__self__.__dict__[_KEY].signature

    @property
    def __doc__(self) -> str | None:  # type: ignore[override]
        return getattr(self.__self__.__dict__[_KEY].original, "__doc__", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__self__.__dict__[_KEY].run(self.__self__, args, kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Forward, (self.__self__,))


def is_attached(model: torch.nn.Module) -> bool:
    return _KEY in model.__dict__


def attach(model: torch.nn.Module, gm: torch.nn.Module, args: tuple, kwargs: dict,
           saved: Any = None) -> torch.nn.Module:
    """Make ``model``'s forward run ``gm`` for the calls ``(args, kwargs)`` stands for (see the
    module docstring); returns ``model``.  ``saved``: the instance's own forward attribute to put
    back on ``detach`` (default: what it is now)."""
    if is_attached(model):
        detach(model)
    original = model.forward
    signature = inspect.signature(original)
    call = _Call.bind(signature, args, kwargs)
    if call is None:
        raise TypeError(f"the example inputs do not bind to {type(model).__name__}.forward{signature}")
    names = list(signature.parameters)
    positional = tuple(names[:len(args)])
    state = InPlace(
        module=gm, original=original, saved=model.__dict__.get("forward", _MISSING) if saved is None else saved,
        signature=signature,
        positional=positional, keywords=tuple(kwargs), passed=call.passed,
        constants={n: v for n, v in call.values.items() if n in call.passed and not _has_tensor(v)},
        training=model.training)
    _install(model, state, state.saved)
    model.__dict__["remat_plan"] = getattr(gm, "remat_plan", None)
    return model


def detach(model: torch.nn.Module) -> torch.nn.Module:
    """Undo ``attach``: the model's forward is its own again; returns ``model``."""
    state: InPlace | Pending | None = model.__dict__.pop(_KEY, None)
    if state is None:
        raise ValueError(f"{type(model).__name__} has no plan attached (remat.checkpoint_ attaches one)")
    _restore(model, state.saved)
    model.__dict__.pop("remat_plan", None)
    model.__dict__.pop("_remat_warned", None)
    return model

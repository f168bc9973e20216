"""The inputs a plan was made for, held at every call of a generated module.

A generated forward starts with ``remat.runtime.check_inputs(self, ...)`` (re-exported there: files
written by ``remat plan --code`` and pickles name it so).  Inputs up to the planned shapes run
exactly; a larger one runs but warns (``RematWarning``) that the budget no longer holds; a
dimension the trace pinned, another number of dimensions or (torch.export graphs, which assert
them) another dtype or autocast raises ``ShapeError``; more CPU threads than planned, or another
autocast around a symbolic trace, warn.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

from .errors import RematWarning, ShapeError

__all__ = ["InputContract", "autocast_state", "check_inputs"]


@dataclass(frozen=True)
class InputContract:
    """The inputs a plan was made for: one entry per graph input, in order."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...] | None, ...]  # None: not a tensor
    dynamic: tuple[tuple[bool, ...] | None, ...]  # per dimension: may it differ from the planned size
    threads: int  # CPU threads the plan assumed
    dtypes: tuple[str | None, ...] = ()  # per input ("torch.int64"; None: not a tensor)
    dtype_pinned: bool = False  # the graph asserts them (torch.export): another dtype cannot run
    autocast: tuple[str, ...] = ()  # the autocast around the planned call: ("cpu:torch.bfloat16",), or none

    def describe(self) -> str:
        return ", ".join(f"{n} {tuple(s)}" for n, s in zip(self.names, self.shapes) if s is not None)


def warn_once(module: torch.nn.Module, key: str, message: str, stacklevel: int = 3) -> None:
    """A RematWarning the first time ``key`` comes up for ``module`` (every call would repeat it)."""
    seen = module.__dict__.setdefault("_remat_warned", set())
    if key not in seen:
        seen.add(key)
        warnings.warn(message, RematWarning, stacklevel=stacklevel)


def autocast_state() -> tuple[str, ...]:
    """The autocast a call runs under: "device:dtype" for each device where it is on."""
    return tuple(f"{d}:{torch.get_autocast_dtype(d)}" for d in ("cpu", "cuda") if torch.is_autocast_enabled(d))


def _autocast_words(state: tuple[str, ...]) -> str:
    if not state:
        return "without autocast"
    return "under " + " and ".join(f"torch.autocast({s.split(':')[0]!r}, dtype={s.split(':')[1]})" for s in state)


def _check_autocast(module: torch.nn.Module, contract: InputContract) -> None:
    now = autocast_state()
    if now == contract.autocast:
        return
    message = (f"this module was planned {_autocast_words(contract.autocast)} and this call runs "
               f"{_autocast_words(now)}")
    if contract.dtype_pinned:
        raise ShapeError(message + ": its torch.export graph asserts the planned dtypes. Call it as planned, or "
                         "plan under this autocast (remat.checkpoint inside the same `with torch.autocast(...)`; "
                         "remat.checkpoint_(model, budget=...) without example inputs plans at the first call)")
    warn_once(module, f"autocast:{now}", message + ": its activations differ from the planned ones and the "
               "memory budget may not hold; plan under the autocast you train with", stacklevel=5)


def check_inputs(module: torch.nn.Module, *values: Any) -> None:
    """Hold the inputs of a call to the plan's contract (see the module docstring)."""
    contract: InputContract | None = getattr(module, "remat_contract", None)
    if contract is None or torch.compiler.is_compiling():
        return
    _check_autocast(module, contract)
    dtypes = contract.dtypes or (None,) * len(contract.names)
    for name, value, planned, dynamic, dtype in zip(contract.names, values, contract.shapes, contract.dynamic, dtypes):
        if planned is None or not isinstance(value, torch.Tensor):
            continue
        if dtype is not None and str(value.dtype) != dtype:
            message = (f"input {name!r} has dtype {value.dtype}; this module was planned for {dtype} (inputs "
                       f"{contract.describe()})")
            if contract.dtype_pinned:
                raise ShapeError(message + ": pass that dtype, or plan again with inputs of the new dtype (a "
                                 "Hugging Face Trainer passes num_items_in_batch as a float32 tensor)")
            warn_once(module, f"dtype:{name}:{value.dtype}", message + ": the plan's memory budget may not hold")
        shape = tuple(value.shape)
        if len(shape) != len(planned):
            raise ShapeError(f"input {name!r} has shape {shape}; this module was planned for {tuple(planned)} "
                             f"(inputs {contract.describe()}): plan again with inputs of the new shape")
        for dim, (size, want, free) in enumerate(zip(shape, planned, dynamic)):
            if not free and size != want:
                raise ShapeError(f"input {name!r} has size {size} in dimension {dim}, but the traced graph fixes it "
                                 f"at {want} (planned inputs: {contract.describe()}): plan again with inputs of the "
                                 "new shape, e.g. remat.checkpoint(model, new_inputs, budget=...)")
        if any(s > w for s, w in zip(shape, planned)):
            warn_once(module, f"shape:{name}:{shape}",
                       f"input {name!r} has shape {shape}, larger than the planned {tuple(planned)}: the plan's memory "
                       "budget no longer holds for it; plan with the largest inputs you will use")
    if torch.get_num_threads() > contract.threads:
        warn_once(module, "threads", f"running with {torch.get_num_threads()} CPU threads where the plan assumed "
                   f"{contract.threads}: kernels keep per-thread scratch, so the step may exceed the budget; plan "
                   "with the thread count you train with")

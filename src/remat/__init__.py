"""remat: automatic activation checkpointing for PyTorch.

The public names are loaded on first use (PEP 562), so ``import remat`` and ``remat --help`` do
not import torch; ``remat.checkpoint`` (or any other name below) does.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Any

__all__ = [
    "FlopCount", "InfeasibleBudget", "InternalError", "KeptOutputOverwritten", "ModelProfile", "NodeProfile", "Plan", "Region",
    "RematError", "RematWarning", "ShapeError", "TraceError",
    "apply_plan", "checkpoint", "checkpoint_", "count_flops", "fully_shard", "load_plan", "measure_peak",
    "profile", "restore_", "trace",
]
__version__ = "0.1.0"

# public name -> (module, attribute, wrapped by errors.public: internal errors become InternalError)
_LAZY: dict[str, tuple[str, str, bool]] = {
    "apply_plan": (".api", "apply_plan", False),
    "checkpoint": (".api", "checkpoint", False),
    "checkpoint_": (".api", "checkpoint_", False),
    "profile": (".profiled", "profile", False),
    "restore_": (".api", "restore_", False),
    "InfeasibleBudget": (".errors", "InfeasibleBudget", False),
    "InternalError": (".errors", "InternalError", False),
    "KeptOutputOverwritten": (".errors", "KeptOutputOverwritten", False),
    "RematError": (".errors", "RematError", False),
    "RematWarning": (".errors", "RematWarning", False),
    "ShapeError": (".errors", "ShapeError", False),
    "TraceError": (".errors", "TraceError", False),
    "public": (".errors", "public", False),
    "measure_peak": (".measure", "measure_peak", True),
    "FlopCount": (".profiler", "FlopCount", False),
    "count_flops": (".profiler", "count_flops", True),
    "ModelProfile": (".profiler.model", "ModelProfile", False),
    "NodeProfile": (".profiler.node", "NodeProfile", False),
    "Plan": (".solvers.base", "Plan", False),
    "Region": (".solvers.base", "Region", False),
    "load_plan": (".solvers.base", "load_plan", False),
    "fully_shard": (".sharding", "fully_shard", True),
    "trace": (".trace", "trace", True),
}


def _load(name: str) -> Any:
    module, attr, wrap = _LAZY[name]
    value = getattr(importlib.import_module(module, __name__), attr)
    if wrap:
        from .errors import public

        value = public(value)
    return value


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        # a submodule (remat.measure, remat.runtime, ...), as an eager import used to make them
        if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
            return importlib.import_module(f".{name}", __name__)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = _load(name)
    if name != "trace":
        globals()[name] = value  # cached: __getattr__ runs once per name
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _Package(types.ModuleType):
    """``remat.trace`` is both a subpackage and the public function: importing the subpackage
    would make the attribute the module, so the attribute is a property that stays the function."""

    _trace: Any = None

    @property
    def trace(self) -> Any:
        if _Package._trace is None:
            _Package._trace = _load("trace")
        return _Package._trace

    @trace.setter
    def trace(self, value: Any) -> None:
        pass  # the import system recording the subpackage; ``sys.modules["remat.trace"]`` has it


sys.modules[__name__].__class__ = _Package

"""Linearization: the graph as a chain of stages (stages.py) and their one cost record (costs.py).

costs.py imports no torch, and plans, regions and the solver table use it (``remat --help`` must
not pay for torch): the linearization's names are imported on first use.
"""
from importlib import import_module
from typing import Any

from .costs import FULL, POLICIES, SAVE_COMPUTE, ChainModel, RegionPolicy

_LINEARIZE = ("Chain", "Stage", "linearize", "cuts", "cut_depths", "module_path", "stage_modules", "MIN_STAGE_FLOPS")

__all__ = ["ChainModel", "RegionPolicy", "FULL", "SAVE_COMPUTE", "POLICIES", *_LINEARIZE]


def __getattr__(name: str) -> Any:
    if name in _LINEARIZE:
        return getattr(import_module(".stages", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""remat: automatic activation checkpointing for PyTorch."""
from .api import apply_plan, checkpoint, profile
from .errors import InfeasibleBudget, RematError, RematWarning, TraceError
from .measure import measure_peak
from .profiler import FlopCount, count_flops
from .profiler.model import ModelProfile
from .profiler.node import NodeProfile
from .solvers.base import Plan, Region, load_plan
from .trace import trace

__all__ = [
    "FlopCount", "InfeasibleBudget", "Plan", "Region", "apply_plan", "checkpoint", "load_plan", "ModelProfile", "NodeProfile", "RematError", "RematWarning", "TraceError",
    "count_flops", "measure_peak", "profile", "trace",
]
__version__ = "0.1.0"

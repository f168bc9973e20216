"""remat: automatic activation checkpointing for PyTorch."""
from .api import apply_plan, checkpoint, profile
from .errors import InfeasibleBudget, InternalError, RematError, RematWarning, TraceError, public
from .measure import measure_peak as _measure_peak
from .profiler import FlopCount
from .profiler import count_flops as _count_flops
from .profiler.model import ModelProfile
from .profiler.node import NodeProfile
from .solvers.base import Plan, Region, load_plan
from .trace import trace as _trace

__all__ = [
    "FlopCount", "InfeasibleBudget", "InternalError", "ModelProfile", "NodeProfile", "Plan", "Region",
    "RematError", "RematWarning", "TraceError",
    "apply_plan", "checkpoint", "count_flops", "load_plan", "measure_peak", "profile", "trace",
]
__version__ = "0.1.0"

count_flops = public(_count_flops)
measure_peak = public(_measure_peak)
trace = public(_trace)

"""remat: automatic activation checkpointing for PyTorch."""
from .api import apply_plan, checkpoint, profile
from .errors import InfeasibleBudget, InternalError, RematError, RematWarning, ShapeError, TraceError, public
from .measure import measure_peak as _measure_peak
from .profiler import FlopCount
from .profiler import count_flops as _count_flops
from .profiler.model import ModelProfile
from .profiler.node import NodeProfile
from .solvers.base import Plan, Region, load_plan
from .sharding import fully_shard as _fully_shard
from .trace import trace as _trace

__all__ = [
    "FlopCount", "InfeasibleBudget", "InternalError", "ModelProfile", "NodeProfile", "Plan", "Region",
    "RematError", "RematWarning", "ShapeError", "TraceError",
    "apply_plan", "checkpoint", "count_flops", "fully_shard", "load_plan", "measure_peak", "profile", "trace",
]
__version__ = "0.1.0"

count_flops = public(_count_flops)
fully_shard = public(_fully_shard)
measure_peak = public(_measure_peak)
trace = public(_trace)

"""remat: automatic activation checkpointing for PyTorch."""
from .profiler import FlopCount, count_flops

__all__ = ["FlopCount", "count_flops"]
__version__ = "0.1.0"

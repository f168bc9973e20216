"""Profiling on fake tensors: FLOP formulas, storage lifetimes, per-node and whole-step passes."""
from .flops import FlopCount, count_flops

__all__ = ["FlopCount", "count_flops"]

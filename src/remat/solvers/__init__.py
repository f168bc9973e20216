"""Checkpointing solvers: from a Chain and a memory limit to nested checkpoint regions."""
from .base import Plan, Region

__all__ = ["Plan", "Region"]

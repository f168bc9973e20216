"""Checkpointing solvers: from a chain model and a memory limit to nested checkpoint regions."""
from .base import Plan, Region
from .registry import DEFAULT_SLOTS, SOLVERS, Solver, SolveSettings, budgeted_solvers, get_solver

__all__ = ["DEFAULT_SLOTS", "Plan", "Region", "SOLVERS", "Solver", "SolveSettings", "budgeted_solvers", "get_solver"]

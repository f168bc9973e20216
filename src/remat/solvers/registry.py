"""Solvers by name: one entry per solver, with what it can do.

The API, the CLI and the sweep all read this table; nothing else lists solver names.  A solver maps
a stage-level ``ChainModel`` and a memory limit (bytes above the resident ones) to nested regions,
or ``None`` when nothing it can build fits.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .base import DEFAULT_SLOTS, Region

if TYPE_CHECKING:  # the implementations import torch; the table itself must not (``remat --help``)
    from ..chain import ChainModel

__all__ = ["Solver", "SolveSettings", "SOLVERS", "DEFAULT_SLOTS", "get_solver", "budgeted_solvers"]


@dataclass(frozen=True)
class SolveSettings:
    """Knobs of one solve: the rotor table's memory resolution and its retry near the floor."""

    slots: int = DEFAULT_SLOTS
    retry: bool = True  # rotor: solve once more at 4x the slots when the table finds nothing
    # Solvers with options: also regions that keep their expensive ops' outputs (torch's selective
    # checkpoint; not for FSDP2 plans, see planner/search.py; a plan torch's selective checkpoint
    # cannot replay in the simulation is planned again without them, with a warning).
    selective: bool = True


RegionsFn = Callable[["ChainModel", int, SolveSettings], "tuple[Region, ...] | None"]


@dataclass(frozen=True)
class Solver:
    """One solver and its capabilities."""

    name: str
    regions: RegionsFn
    budgeted: bool  # takes the memory limit into account (else a fixed plan, checked afterwards)
    optimal: bool  # least recomputation under the stage model among all nested plans
    help: str
    least: "Callable[[ChainModel, SolveSettings], tuple[Region, ...]] | None" = None  # its least-memory plan
    options: bool = False  # chooses per-op keep/recompute options inside stages


def _none(model: ChainModel, limit: int, settings: SolveSettings) -> tuple[Region, ...]:
    return ()


def _every_stage(model: ChainModel, limit: int, settings: SolveSettings) -> tuple[Region, ...]:
    return tuple(Region(i, i + 1) for i in range(len(model)))


def _sqrtn(model: ChainModel, limit: int, settings: SolveSettings) -> tuple[Region, ...]:
    from .chen import sqrtn_regions

    return sqrtn_regions(len(model))


def _greedy(model: ChainModel, limit: int, settings: SolveSettings) -> tuple[Region, ...] | None:
    from .chen import greedy_regions

    return greedy_regions(model, limit)


def _greedy_least(model: ChainModel, settings: SolveSettings) -> tuple[Region, ...]:
    from .chen import greedy_candidates
    from .model import evaluate

    return min(greedy_candidates(model), key=lambda r: evaluate(model, r).peak)


def _rotor(model: ChainModel, limit: int, settings: SolveSettings) -> tuple[Region, ...] | None:
    from .rotor import solve_rotor

    return solve_rotor(model, limit, settings.slots, settings.retry, settings.selective)


def _rotor_least(model: ChainModel, settings: SolveSettings) -> tuple[Region, ...]:
    """One table over the memory of the step without checkpointing; its first feasible column is
    the least memory, and the schedule rebuilt there the fastest plan within it."""
    from .model import evaluate
    from .rotor import rotor_plan

    top = evaluate(model, ()).peak
    return rotor_plan(model, max(top, 1), settings.slots, settings.selective, least=True) or ()


SOLVERS: dict[str, Solver] = {s.name: s for s in (
    Solver("rotor", _rotor, budgeted=True, optimal=True, least=_rotor_least, options=True,
           help="optimal nested regions under the budget (dynamic program, Beaumont et al. 2019), each "
                "recomputing everything or keeping its matmul/conv/attention outputs; the default"),
    Solver("chen-greedy", _greedy, budgeted=True, optimal=False, least=_greedy_least,
           help="Chen et al. 2016's greedy segments: one level of regions, the least recompute that fits"),
    Solver("chen-sqrtn", _sqrtn, budgeted=False, optimal=False,
           help="Chen et al. 2016's sqrt(n) segments, whatever the budget"),
    Solver("every-stage", _every_stage, budgeted=False, optimal=False,
           help="checkpoint every stage (like hand-placed checkpoints around every block)"),
    Solver("none", _none, budgeted=False, optimal=False, help="no checkpointing: the traced model as is"),
)}


def get_solver(name: str) -> Solver:
    """The solver called ``name``; a ValueError listing the choices otherwise."""
    solver = SOLVERS.get(name)
    if solver is None:
        raise ValueError(f"unknown solver {name!r}; choose one of {', '.join(SOLVERS)}")
    return solver


def budgeted_solvers() -> tuple[str, ...]:
    return tuple(name for name, s in SOLVERS.items() if s.budgeted)

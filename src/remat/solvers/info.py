"""What a plan records besides its regions: ``PlanInfo``, typed, with units.

A plan is data (``Plan.to_json``); these fields are what ``describe()`` prints and what users and
benchmarks read.  ``PlanInfo`` still reads like the dict it replaces (``plan.info["inputs"]``,
``plan.info.get("granularity")``), and JSON plans written before it load into it: keys it does
not know are kept in ``extra``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["PlanInfo"]


@dataclass
class PlanInfo:
    """Everything a plan knows about its problem and its making.  Bytes are ints, times seconds."""

    unconstrained_peak_bytes: int | None = None  # the step's predicted peak as the model runs it
    fixed_bytes: int | None = None  # resident + one gradient per trainable parameter: no plan goes below
    resident_bytes: int | None = None  # parameters, buffers, inputs (and library workspaces) before the step
    margin_bytes: int = 0  # kept free of the budget: the measured error of predictions (margin.py)
    bound_bytes: int | None = None  # the least peak any checkpointing of the model's code reaches
    bound_reason: str = ""  # which op (or the fixed bytes) sets the bound
    granularity: str = "blocks"  # "blocks" (no skip crosses a cut) or "fine" (cuts inside blocks)
    stage_modules: list[list[str]] = field(default_factory=list)  # per stage: first and last module path
    keep_refused: list[list[Any]] = field(default_factory=list)  # [stage, why] where no region may keep outputs
    recompute_seconds: float = 0.0  # predicted time of the recomputation
    step_seconds: float = 0.0  # predicted time of the un-checkpointed step (forward and backward)
    # the least predicted recomputation of any plan in remat's space at the budget (rotor's optimum on
    # the stage model, unverified; at the plan's own peak when no budget was given): how far this plan is
    # from what the model believes possible
    best_recompute_seconds: float | None = None
    solve_seconds: float = 0.0  # wall time of planning (solve, generate, verify)
    attempts: int = 1  # solve/verify rounds
    slots: int = 0  # the rotor table's memory resolution
    frontend: str = ""  # "symbolic_trace" or "export"
    inputs: dict[str, list[int]] = field(default_factory=dict)  # the planned shape of each input
    device: str = "cpu"  # the device the step was planned for
    threads: int = 1  # CPU threads the plan assumes
    times: str = ""  # where op times come from
    simulated_on: str = ""  # the stand-in device of a GPU plan made without a GPU
    scratch: str = ""  # kernel scratch: "measured" on this machine or bounded by the "rules"
    measured_signatures: int = 0  # op signatures this plan measured (the rest came from the cache)
    estimated_calls: int = 0  # op calls left to the rules
    user_checkpoints: int = 0  # the model's own checkpoint calls
    user_checkpoints_kept: bool = False  # the step fit as the model checkpoints it: kept
    world_size: int = 1  # FSDP2 processes (with sharding)
    sharding: str = ""  # "fsdp" for a per-process FSDP2 plan
    extra: dict[str, Any] = field(default_factory=dict)  # keys of a plan from another version

    # --- the dict it was, for code written against it ------------------------------------------
    def _known(self) -> set[str]:
        return {f.name for f in fields(self)} - {"extra"}

    def __getitem__(self, key: str) -> Any:
        if key in self._known():
            return getattr(self, key)
        return self.extra[key]

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def __contains__(self, key: str) -> bool:
        return key in self._known() or key in self.extra

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: the fields, then the unknown keys, flat as plans always wrote them."""
        out = {name: getattr(self, name) for name in sorted(self._known())}
        out.update(self.extra)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "PlanInfo":
        data = dict(data or {})
        known = {f.name for f in fields(cls)} - {"extra"}
        return cls(**{k: v for k, v in data.items() if k in known},
                   extra={k: v for k, v in data.items() if k not in known})

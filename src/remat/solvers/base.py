"""Plans as data: which stage ranges are checkpointed (nested), and what the solver predicts."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..chain import FULL, POLICIES, SAVE_COMPUTE, RegionPolicy
from .info import PlanInfo

__all__ = ["Region", "RegionPolicy", "Plan", "load_plan", "FULL", "SAVE_COMPUTE", "POLICIES", "DEFAULT_SLOTS"]

# Memory resolution of the rotor table: a slot is 1/500 of the limit, so rounding costs at most
# 0.2 % of it per stored size; the table (L x L x 3 x 501 float32, padded) is ~100 MB at 128 stages,
# the planner's coarsening limit.
DEFAULT_SLOTS = 500


@dataclass(frozen=True)
class Region:
    """Stages [start, stop) run under one checkpoint; ``children`` are checkpointed inside it.

    ``policy`` (SAVE_COMPUTE) keeps the expensive ops' outputs; such a region has no children."""

    start: int
    stop: int
    children: tuple["Region", ...] = ()
    policy: RegionPolicy = FULL

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.stop:
            raise ValueError(f"empty or negative region [{self.start}, {self.stop})")
        try:
            object.__setattr__(self, "policy", RegionPolicy(self.policy))
        except ValueError:
            raise ValueError(f"unknown region policy {self.policy!r}; one of {[p.value for p in POLICIES]}") from None
        if self.policy != FULL and self.children:
            raise ValueError("a region that keeps some outputs has no regions inside it")
        prev = self.start
        for child in self.children:
            if child.start < prev or child.stop > self.stop:
                raise ValueError(f"region {child} does not nest inside [{self.start}, {self.stop}) in order")
            prev = child.stop

    def to_list(self) -> list[Any]:
        return [self.start, self.stop, [c.to_list() for c in self.children],
                *([self.policy.value] if self.policy != FULL else [])]

    @classmethod
    def from_list(cls, data: list[Any]) -> "Region":
        start, stop, children, *policy = data
        return cls(int(start), int(stop), tuple(cls.from_list(c) for c in children), *policy)


def validate_regions(regions: tuple[Region, ...] | list[Region], n_stages: int) -> None:
    prev = 0
    for r in regions:
        if r.start < prev or r.stop > n_stages:
            raise ValueError(f"regions must be disjoint, ordered and within the {n_stages} stages; got {r}")
        prev = r.stop


def _block(path: str) -> str:
    """A module path up to its first index into a list of blocks ("transformer.h.3.attn" ->
    "transformer.h.3"); the whole path when it has none."""
    parts = path.split(".") if path else []
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return path


def _span(first: str, last: str) -> tuple[str, str]:
    """How a region's first and last module are shown: the blocks they are in ("transformer.h.2" ..
    "transformer.h.4"), or inside one block, the paths one level below what they share;
    "(model)" for the model's own top-level code."""
    a, b = _block(first), _block(last)
    if a != b:
        return a or "(model)", b or "(model)"
    pa, pb = first.split(".") if first else [], last.split(".") if last else []
    common = 0
    while common < min(len(pa), len(pb)) and pa[common] == pb[common]:
        common += 1
    return ".".join(pa[:common + 1]) or "(model)", ".".join(pb[:common + 1]) or "(model)"


# what a chain's granularity means, for describe()
_LEVELS = {
    "blocks": "the graph cut into consecutive pieces where no skip connection crosses a cut",
    "fine": "the graph cut into consecutive pieces, also inside residual blocks, where a skip value crosses a cut",
}


@dataclass
class Plan:
    """A checkpointing plan for one model and input shape (``Plan.to_json`` / ``remat.load_plan``)."""

    solver: str
    budget_bytes: int | None
    predicted_peak_bytes: int
    recompute_flops: int
    stages: list[list[str]]  # node names per stage
    regions: tuple[Region, ...] = ()
    step_flops: int = 0  # forward + backward FLOPs of the unmodified step
    info: PlanInfo = field(default_factory=PlanInfo)

    def __post_init__(self) -> None:
        if not isinstance(self.info, PlanInfo):  # a dict: plans made or saved before PlanInfo
            self.info = PlanInfo.from_dict(self.info)

    @property
    def recompute_ratio(self) -> float:
        return self.recompute_flops / self.step_flops if self.step_flops else 0.0

    def describe(self) -> str:
        """The plan for people: budget, prediction, recomputation and the nested regions."""
        from ..units import fmt_bytes

        level = self.info.granularity
        lines = [f"solver {self.solver}, {len(self.stages)} stages ({level}: {_LEVELS.get(level, level)})"]
        if self.info.sharding:
            lines.append(f"memory per process of {self.info.world_size} "
                         f"({self.info.sharding}: wrap with remat.fully_shard)")
        unconstrained = self.info.unconstrained_peak_bytes
        if unconstrained is not None:
            lines.append(f"unconstrained   {fmt_bytes(unconstrained):>12}   (the step's peak as the model runs it)")
        if self.budget_bytes is not None:
            lines.append(f"budget          {fmt_bytes(self.budget_bytes):>12}")
        if self.info.bound_bytes:
            lines.append(f"bound           {fmt_bytes(self.info.bound_bytes):>12}   (no checkpointing of this model's "
                         f"code goes below: {self.info.bound_reason})")
        lines.append(f"predicted peak  {fmt_bytes(self.predicted_peak_bytes):>12}"
                     + (f"   ({'fits' if self.predicted_peak_bytes <= self.budget_bytes else 'OVER'})"
                        if self.budget_bytes is not None else ""))
        if self.info.margin_bytes:
            lines.append(f"margin          {fmt_bytes(self.info.margin_bytes):>12}   (kept free of the budget: "
                         "the measured error of predictions, remat/margin.py)")
        lines.append(f"recompute       {self.recompute_ratio:>12.1%} of the step's FLOPs")
        if self.info.step_seconds:
            overhead = self.info.recompute_seconds / self.info.step_seconds
            lines.append(f"predicted time  {overhead:>+12.1%} on the step (recomputation, from measured or "
                         "roofline op times)")
            best = self.info.best_recompute_seconds
            if best is not None:
                lines.append(f"best possible   {best / self.info.step_seconds:>+12.1%}   (the fastest plan in remat's "
                             "space at this budget, as the model predicts: rotor's optimum)")
        scratch = self.info.scratch
        if scratch == "measured":
            lines.append(f"kernel scratch  measured on this machine ({self.info.threads} threads; "
                         f"{self.info.measured_signatures} new op signatures measured, the rest cached)")
        elif scratch == "rules" and self.info.device != "cpu":
            lines.append(f"kernel scratch  bounded by remat's {self.info.device} rules (not measured: remat "
                         "measures kernels on this machine's CPU only)")
        elif scratch == "rules":
            lines.append("kernel scratch  bounded by remat's rules (the ops could not run here: inputs on meta, "
                         "another device, or calibrate=False)")
        if self.info.device != "cpu":
            where = (f", simulated on fake {self.info.simulated_on} tensors standing in for it"
                     if self.info.simulated_on else "")
            lines.append(f"planned for     {self.info.device}{where}; op times {self.info.times}")
        users = self.info.user_checkpoints
        if users:
            verdict = ("kept: the step fits the budget as the model checkpoints it" if self.info.user_checkpoints_kept
                       else "replaced by the regions below")
            lines.append(f"the model's own checkpoint calls ({users}): {verdict}")
        refused = self.info.keep_refused
        if refused:
            stage, why = refused[0]
            lines.append(f"no region keeps matmul/conv/attention outputs in {len(refused)} of {len(self.stages)} stages: "
                         "a later op writes such an output in place, and torch's selective checkpoint would hand "
                         f"the overwritten tensor to the recomputation (e.g. stage {stage}, {why})")
        if not self.regions and not (users and self.info.user_checkpoints_kept):
            lines.append("no checkpointing")

        modules = self.info.stage_modules

        def walk(regions: tuple[Region, ...], depth: int) -> None:
            for r in regions:
                if modules and len(modules) == len(self.stages):
                    first, last = _span(modules[r.start][0], modules[r.stop - 1][1])
                else:  # plans saved before module paths were recorded: fx's node names
                    first, last = self.stages[r.start][0], self.stages[r.stop - 1][-1]
                how = ", keeping matmul/conv/attention outputs" if r.policy == SAVE_COMPUTE else ""
                covers = first if first == last else f"{first} .. {last}"
                lines.append(f"{'  ' * depth}- checkpoint stages {r.start}..{r.stop - 1}{how}: {covers}")
                walk(r.children, depth + 1)

        walk(tuple(self.regions), 1)
        return "\n".join(lines)

    def to_json(self, path: str | Path | None = None) -> str:
        data = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
        data["regions"] = [r.to_list() for r in self.regions]
        data["info"] = self.info.to_dict()
        text = json.dumps(data, indent=1)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        data = json.loads(text)
        data["regions"] = tuple(Region.from_list(r) for r in data.get("regions", []))
        return cls(**data)


def load_plan(path: str | Path) -> Plan:
    return Plan.from_json(Path(path).read_text())

"""What planning needs, computed once per model and input shape: the trace, the profile, the chains.

``prepare`` traces and profiles the model, then linearizes the graph at two granularities ("blocks":
no skip connection crosses a cut; "fine": cuts inside residual blocks too) and coarsens each chain
to at most ``MAX_STAGES`` stages for the solvers.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import fx

from ..chain import Chain, ChainModel, cut_depths, linearize
from ..codegen import NodeRegion
from ..margin import Margin, margin_for
from ..profiler.calibrate import Calibration
from ..profiler.dispatch import ScratchSource, Target
from ..profiler.bound import Bound
from ..profiler.model import ModelProfile
from ..profiler.step import simulate_step
from ..profiler.timing import machine
from ..sharding import SHARDINGS, ShardModel, shard_chain, shard_model
from ..profiled import trace_and_profile

__all__ = ["Granularity", "Problem", "prepare", "coarsen", "MAX_STAGES"]

# The rotor table grows as stages^2 x slots: 128 stages keep one solve under a second or two on 2
# cores (benchmarks/solvers.py times the DP), and deep models keep blocks of a few layers each.
MAX_STAGES = 128


@dataclass
class Granularity:
    """One linearization of the graph and the (possibly coarsened) stage model solvers see."""

    name: str  # "blocks" or "fine"
    chain: Chain
    model: ChainModel  # what the solvers see: ``exact`` coarsened to at most MAX_STAGES stages
    groups: list[tuple[int, int]]  # model stage -> chain stages [a, b)

    @property
    def exact(self) -> ChainModel:
        """The chain's own stage model, built once by linearize: plans are evaluated on it."""
        return self.chain.model


@dataclass
class Problem:
    """Everything solving needs, computed once per model and input shape."""

    gm: fx.GraphModule
    args: tuple
    kwargs: dict
    profile: ModelProfile
    baseline: fx.GraphModule  # the step as the model runs it: with its own checkpoint calls, if any
    user_regions: tuple[NodeRegion, ...] = ()  # the model's own checkpoint calls (inputs.py)
    levels: dict[str, Granularity] = field(default_factory=dict)
    target: Target = field(default_factory=Target)
    scratch: ScratchSource | None = None  # None: the memory rules' bounds (else measured, calibrate.py)
    shard: ShardModel | None = None  # FSDP2 planning: per-process terms (sharding.py)
    sharded_peak: int = 0  # the unconstrained step's predicted per-process peak, when sharded
    # each solver's least-memory regions per granularity and settings: they do not depend on the
    # budget, and the CLI's early floor, an infeasible budget and budget="min" all ask for them
    least_regions: dict[tuple, object] = field(default_factory=dict, repr=False)

    @property
    def chain(self) -> Chain:
        return self.levels["blocks"].chain

    @property
    def model(self) -> ChainModel:
        return self.levels["blocks"].model

    @property
    def resident(self) -> int:
        """Bytes outside the stage model: resident before the step (with FSDP2, per process, plus
        the allowance for its gathered units and collective buffers)."""
        if self.shard is not None:
            return self.shard.resident + self.shard.allowance
        return self.profile.resident_bytes

    @property
    def fixed(self) -> int:
        """Resident bytes plus every parameter gradient: the floor no schedule goes below."""
        grads = self.profile.grad_bytes
        return self.resident + (self.shard.grad_bytes(grads) if self.shard is not None else grads)

    @property
    def bound(self) -> Bound | None:
        """The least peak any checkpointing of the step can reach (profiler/bound.py); None when
        sharded, where per-process terms are not those of the profile's step."""
        return None if self.shard is not None else self.profile.bound

    @property
    def unconstrained(self) -> int:
        return self.sharded_peak if self.shard is not None else self.profile.peak_bytes

    def predict(self, gm: fx.GraphModule) -> int:
        """Predicted peak of one training step of ``gm`` (a generated module of this problem)."""
        if self.shard is None:
            return simulate_step(gm, self.args, self.kwargs, target=self.target, scratch=self.scratch).peak
        step = simulate_step(gm, self.args, self.kwargs, self.shard.grad_shards, self.target, self.scratch)
        return self.resident + step.peak_above

    @property
    def scratch_source(self) -> str:
        """Where kernel scratch comes from: "measured" on this machine, or the "rules"' bounds."""
        return "measured" if isinstance(self.scratch, Calibration) else "rules"

    @property
    def margin(self) -> Margin:
        """How far a real peak may exceed this problem's predictions (by where scratch came from)."""
        return margin_for(self.scratch_source, self.target.device.type)

    def scratch_info(self) -> dict[str, object]:
        """Where kernel scratch came from, for the plan: measured here, or the rules' bounds; the
        device planned for, and where op times come from."""
        info: dict[str, object] = {"threads": self.target.threads, "device": self.target.device.type,
                                   "times": machine(self.target.device.type, self.target.threads).source}
        if self.target.stand_in:
            info["simulated_on"] = self.target.fake_device.type  # profiler/standin.py
        if self.scratch_source == "rules":
            info["scratch"] = "rules"
        else:
            self.scratch.flush()
            info.update(scratch="measured", measured_signatures=self.scratch.measured,
                        estimated_calls=self.scratch.estimated)
        return info


def coarsen(model: ChainModel, max_stages: int,
            depths: Sequence[int] | None = None) -> tuple[ChainModel, list[tuple[int, int]]]:
    """Merge neighbouring stages until at most ``max_stages`` remain; returns the merged model and
    each merged stage's range.

    ``depths[i]``: how deep in the module tree the cut before stage i lies (the length of the
    module path its two sides share).  The deepest cuts go first (inside a Linear before inside an
    attention, inside a layer before between layers), then the pair with the least forward work:
    the cuts left are the model's own module boundaries, where people checkpoint.  Merging by work
    alone left no cut between two Llama decoder layers (8 x 512: 486 stages into 128), and rotor's
    floor lay 19 MiB above checkpointing every layer by hand.
    """
    groups = [(i, i + 1) for i in range(len(model))]
    work = list(model.fwd_flops)
    depth = list(depths) if depths is not None else [0] * len(model)
    while len(groups) > max_stages:
        j = min(range(len(groups) - 1), key=lambda i: (-depth[groups[i + 1][0]], work[i] + work[i + 1]))
        groups[j:j + 2] = [(groups[j][0], groups[j + 1][1])]
        work[j:j + 2] = [work[j] + work[j + 1]]
    if len(groups) == len(model):
        return model, groups
    return model.merged(groups), groups


def prepare(model: torch.nn.Module, args: tuple, kwargs: dict | None = None,
            shared_inputs: tuple[str, ...] = (), max_stages: int = MAX_STAGES, *,
            world_size: int = 1, sharding: str | None = None, calibrate: bool | None = None,
            check: bool = True, device: str | torch.device | None = None) -> Problem:
    """Trace, profile and linearize once; ``sharding="fsdp"`` plans per process (sharding.py).

    ``calibrate``: measure kernel scratch on this machine (None: when the model and inputs are
    real CPU tensors; profiler/calibrate.py).  ``device``: the device the step will run on ("cuda"
    plans a GPU step from a model on the CPU or meta; default: where the model's tensors are)."""
    if sharding not in (None, *SHARDINGS):
        raise ValueError(f"unknown sharding {sharding!r}; choose None or one of {', '.join(SHARDINGS)}")
    if sharding is None and world_size != 1:
        raise ValueError("world_size only changes the plan with sharding='fsdp'; under DDP every process "
                         "holds the whole model, so plan with the defaults")
    done = trace_and_profile(model, args, kwargs, calibrate, check, device)
    gm, prof = done.gm, done.profile
    problem = Problem(gm, args, kwargs or {}, prof, done.baseline, done.user_regions, target=done.target,
                      scratch=done.scratch)
    if sharding == "fsdp":
        problem.shard = shard_model(gm, world_size, prof.buffer_bytes + prof.input_bytes)
        problem.sharded_peak = problem.predict(done.baseline)
    # torch's checkpoint stashes the CPU generator's state for a region drawing random numbers; the
    # simulated step counts it on CPU targets only (profiler/dispatch.py), so does the stage model
    rng_state = torch.get_rng_state().untyped_storage().nbytes() if done.target.device.type == "cpu" else 0
    for name, split in (("blocks", False), ("fine", True)):
        chain = linearize(gm, shared_inputs, split_blocks=split, loss_peak=prof.loss_peak_bytes,
                          loss_grad=prof.loss_grad_bytes, rng_state=rng_state)
        if problem.shard is not None:
            chain = shard_chain(chain, problem.shard)
        coarse, groups = coarsen(chain.model, max_stages, cut_depths(gm, chain))
        problem.levels[name] = Granularity(name, chain, coarse, groups)
    if len(problem.levels["fine"].chain) == len(problem.chain):
        del problem.levels["fine"]  # no block to split
    return problem

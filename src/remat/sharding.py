"""Planning for FSDP2: parameters and gradients sharded N ways, the budget per process.

The prediction assumes the layout ``remat.fully_shard`` builds: every module the graph calls
(``call_module``) that owns parameters is its own FSDP2 unit, and the root module is one more unit
holding every other parameter (those the graph reads with ``get_attr``: ViT's class token, the
parameters of a torch.export graph).  Per process, a training step then holds:

* resident: buffers, inputs, each parameter's shard (dim 0 padded to a multiple of N, as FSDP2
  pads), and the root unit's parameters unsharded: the root gathers them when the forward starts
  and keeps them to the end of the backward;
* gradients: a unit's gradients are reduce-scattered as soon as its backward is done, so each
  unit parameter keeps only its shard's gradient; the root's gradients stay whole until the end;
* an allowance for what FSDP2 holds around one unit at a time: the gathered parameters, full
  gradients and reduce-scatter buffers of the largest unit, the previous unit's reduce-scatter
  input, the next unit prefetched during the backward, and the root's reduce-scatter at the end.
  Collective backends add working copies (gloo reduce-scatters through an all-reduce of a copy);
  the allowance counts one per collective.  Collectives finish asynchronously, so a real peak
  varies from run to run by up to about one unit; the allowance is sized for that.

The activations are those of the unsharded step, so the solvers see the same chain with smaller
parameter gradients; the verification simulates the step with every unit gradient replaced by its
shard the moment it is accumulated.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass

import torch
from torch import fx

from .chain import Chain
from .errors import RematWarning
from .units import fmt_bytes

__all__ = ["ShardModel", "shard_model", "shard_chain", "shard_bytes", "fully_shard", "unit_names"]

SHARDINGS = ("fsdp",)


def shard_bytes(p: torch.Tensor, world_size: int) -> int:
    """Bytes of one rank's shard of ``p``: FSDP2 pads dim 0 to a multiple of the world size."""
    if p.dim() == 0:
        return p.element_size()
    rows = math.ceil(p.shape[0] / world_size)
    return rows * (p.numel() // max(1, p.shape[0])) * p.element_size()


def _full_bytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


def unit_names(gm: fx.GraphModule) -> list[str]:
    """Modules called by the graph that own parameters and share none with another unit or with
    a ``get_attr`` read: each becomes its own FSDP2 unit; every other parameter stays in the root."""
    called = list(dict.fromkeys(n.target for n in gm.graph.nodes if n.op == "call_module"))
    read = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    read_ids = {id(p) for name, p in gm.named_parameters(remove_duplicate=False) if name in read}
    owners: dict[int, set[str]] = {}
    for name in called:
        for p in gm.get_submodule(name).parameters():
            owners.setdefault(id(p), set()).add(name)
    units = []
    for name in called:
        params = list(gm.get_submodule(name).parameters())
        if params and all(owners[id(p)] == {name} and id(p) not in read_ids for p in params):
            units.append(name)
    return units


@dataclass(frozen=True)
class ShardModel:
    """Per-process memory terms of an FSDP2 step that do not depend on the checkpoint plan."""

    world_size: int
    units: tuple[str, ...]  # module names sharded as their own unit
    resident: int  # buffers + inputs + parameter shards + the root unit's parameters unsharded
    allowance: int  # FSDP2's transient bytes around one unit (see the module docstring)
    grad_shards: dict[str, int]  # trainable unit parameter -> its gradient shard's bytes
    grad_saving: dict[str, int]  # graph node -> gradient bytes that sharding removes after its backward

    def grad_bytes(self, full_grad_bytes: int) -> int:
        """Gradient bytes alive at the end of the step, from the unsharded step's."""
        return full_grad_bytes - sum(self.grad_saving.values())


def shard_model(gm: fx.GraphModule, world_size: int, buffer_and_input_bytes: int) -> ShardModel:
    """The sharded step's plan-independent terms for ``gm`` split over ``world_size`` processes."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    units = unit_names(gm)
    in_unit: dict[int, str] = {}
    for name in units:
        for p in gm.get_submodule(name).parameters():
            in_unit[id(p)] = name
    params = dict(gm.named_parameters())
    root = [p for p in params.values() if id(p) not in in_unit]
    sizes = {}  # unit -> (gathered bytes, shard bytes)
    grad_shards, grad_saving = {}, {}
    node_of = {n.target: n.name for n in gm.graph.nodes if n.op == "call_module"}
    for name in units:
        ps = list(gm.get_submodule(name).parameters())
        shard = sum(shard_bytes(p, world_size) for p in ps)
        sizes[name] = (shard * world_size, shard)
        saving = 0
        for pname, p in gm.get_submodule(name).named_parameters():
            if p.requires_grad:
                grad_shards[f"{name}.{pname}"] = shard_bytes(p, world_size)
                saving += _full_bytes(p) - shard_bytes(p, world_size)
        grad_saving[node_of[name]] = saving
    root_full = sum(_full_bytes(p) for p in root)
    root_shard = sum(shard_bytes(p, world_size) for p in root)
    unit_full = sum(g for g, _ in sizes.values())
    if world_size > 1 and root_full > unit_full:
        warnings.warn(
            f"remat: FSDP2 would hold {fmt_bytes(root_full)} of {fmt_bytes(root_full + unit_full)} of parameters "
            f"whole at the root for the whole step: the graph reads them with get_attr instead of "
            f"calling the modules that own them ({len(units)} unit(s) called; a torch.export trace inlines every "
            f"module call), so sharding saves little; the plan counts them whole", RematWarning, stacklevel=3)
    biggest = sorted(sizes.values(), reverse=True)[:2] + [(0, 0), (0, 0)]
    (g1, s1), (g2, s2) = biggest[0], biggest[1]
    # Around the largest unit's backward, in unit-sized (gathered) buffers g1 and shards s1:
    #   g1  its gathered parameters        g1  its full gradients
    #   g1  the reduce-scatter input       g1  the backend's working copy of it (gloo reduce-scatters
    #   s1  the reduce-scatter output           through an all-reduce of a copy)
    # The second-largest unit (g2, s2) for what overlaps it: the previous unit's reduce-scatter
    # input, freed only when this one starts, and the next unit prefetched (all-gather input copy,
    # output buffer, the backend's per-rank outputs, the copied-out parameters): 4 * g2 + s2 again.
    # The root's reduce-scatter at the end of the backward: input and working copy, and the shard.
    # Where each term comes from in torch 2.14's FSDP2 (torch/distributed/fsdp/_fully_shard/
    # _fsdp_collectives.py): foreach_all_gather allocates the all-gather output (world_size x the
    # padded shards: g) with the input as a view of it, then foreach_all_gather_copy_out makes the
    # unsharded parameters (empty_like each: g) while the output is alive; foreach_reduce allocates
    # reduce_scatter_input (g, the unsharded gradients copied in while they are alive: g) and
    # reduce_output (s); gloo, which has no native reduce-scatter, works on a copy of its input (g).
    # Measured on resnet50 and a 12-block MLP over gloo (benchmarks/fsdp.py, tests/test_distributed.py):
    # 3 * g + 2 * s was overrun by 0.5 MB in 1 of 6 runs; this bound was not in 12, nor in 10 runs of
    # tests/test_distributed.py's FSDP2 test (2 processes each) beside a fuzz soak loading both cores
    # (load 3.9 on 2 cores, 2026-12-05): every process at most 0.841 of its budget.
    allowance = (4 * g1 + s1) + (4 * g2 + s2) + (2 * root_shard * world_size + root_shard)
    resident = buffer_and_input_bytes + sum(s for _, s in sizes.values()) + root_shard + root_full
    return ShardModel(world_size, tuple(units), resident, allowance, grad_shards, grad_saving)


def shard_chain(chain: Chain, shard: ShardModel) -> Chain:
    """The chain with each stage's parameter gradients reduced to what stays after reduce-scatter."""
    kept = tuple(max(0, g - sum(shard.grad_saving.get(n, 0) for n in s.nodes))
                 for s, g in zip(chain.stages, chain.model.param_grad))
    return dataclasses.replace(chain, model=dataclasses.replace(chain.model, param_grad=kept))


def fully_shard(gm: torch.nn.Module, mesh=None, **kwargs) -> torch.nn.Module:
    """Apply FSDP2's ``fully_shard`` in the layout ``sharding="fsdp"`` plans for: each parameter-
    owning module the graph calls is a unit, the root holds the rest.  Returns ``gm``, sharded."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    if not isinstance(gm, fx.GraphModule):
        raise TypeError("remat.fully_shard expects the GraphModule remat.checkpoint returned")
    for name in unit_names(gm):
        torch_fully_shard(gm.get_submodule(name), mesh=mesh, **kwargs)
    return torch_fully_shard(gm, mesh=mesh, **kwargs)

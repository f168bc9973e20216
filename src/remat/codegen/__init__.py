"""Rewrite a traced GraphModule so each planned region runs under ``torch.utils.checkpoint``.

The graph itself is unchanged; only its Python code is (``trace/body.py``, a body transformer registered
with ``Graph.on_generate_code``).  The result is a ``runtime.RematModule`` sharing the traced
module's submodules and parameters under the same names; ``gm.code`` shows the regions.

What a region's checkpoint call passes, beyond ``use_reentrant=False``:

* ``preserve_rng_state=False`` unless the region draws random numbers (an op torch tags
  ``nondeterministic_seeded``, with a nonzero ``dropout_p`` where the op has one): no RNG state
  to stash, no replay.  Regions with dropout keep the default, so recomputation replays the masks.
* ``early_stop=False`` when an op of the region writes a tensor it does not return (rrelu's noise):
  torch's checkpoint would stop recomputing where autograd saves that tensor, before the kernel
  fills it, and the backward would read uninitialized memory (NaN gradients).
* ``**remat.runtime.context(self, save="compute")`` for a region that keeps its matmul, conv and
  attention outputs (torch's selective checkpointing); ``freeze=...`` when the region writes module
  state: recomputation must not update BatchNorm statistics a second time, and must see other state
  (spectral norm's power iteration) as its forward did (runtime.py).
"""
from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import fx

from ..chain import Chain
from ..profiler.node import META_KEY
from ..contract import InputContract
from ..runtime import Freeze, RematModule, Save
from ..solvers.base import SAVE_COMPUTE, Region, validate_regions
from ..trace.modes import MODES_KEY
from ..trace.body import Layout, Nester, NodeRegion

__all__ = ["NodeRegion", "build", "generate", "regions_from_stages"]

# attributes the traced module carries that its generated modules keep
_CARRIED = ("_in_spec", "_out_spec", "remat_frontend", "remat_user_regions", "remat_contract")


def regions_from_stages(chain: Chain, regions: Sequence[Region]) -> tuple[NodeRegion, ...]:
    """Regions over the chain's stages -> regions over graph nodes."""
    return tuple(NodeRegion(chain.stages[r.start].first, chain.stages[r.stop - 1].last,
                            regions_from_stages(chain, r.children),
                            f"stages {r.start}..{r.stop - 1}" + (", keeping matmul/conv/attention outputs"
                                                                  if r.policy == SAVE_COMPUTE else ""),
                            policy=r.policy)
                 for r in regions)


def _any_node(gm: fx.GraphModule, region: NodeRegion, flag: str) -> bool:
    nodes = list(gm.graph.nodes)
    return any(getattr(nodes[i].meta.get(META_KEY), flag, False) for i in range(region.first, region.last + 1))


def _state_written_by_batchnorm_modules(gm: fx.GraphModule) -> bool:
    """True when every node that writes module state is a call to a BatchNorm module."""
    for node in gm.graph.nodes:
        if getattr(node.meta.get(META_KEY), "mutates_state", False):
            if node.op != "call_module":
                return False
            if not isinstance(gm.get_submodule(node.target), torch.nn.modules.batchnorm._BatchNorm):
                return False
    return True


def _freeze(gm: fx.GraphModule, region: NodeRegion) -> str:
    """How a region that writes module state is recomputed without writing it twice.

    BatchNorm modules (symbolic traces) only write running statistics, which a training step never
    reads back: recomputation runs them with momentum 0, at no cost.  Other state may be read
    after it is written (spectral norm's power iteration updates ``_u``/``_v``, then builds the
    weight from them), and in a torch.export graph the ops do not say which module they belong to:
    the region recomputes from a copy of the state it writes, taken in its forward."""
    if _state_written_by_batchnorm_modules(gm):
        return f'freeze="{Freeze.MODULES.value}"'
    nodes = list(gm.graph.nodes)[region.first:region.last + 1]
    names = sorted({name for n in nodes for name in getattr(n.meta.get(META_KEY), "state_written", ())})
    if names:
        return f'freeze="{Freeze.STATE.value}", state={tuple(names)!r}'
    return f'freeze="{Freeze.OPS.value}"'


def region_options(gm: fx.GraphModule, region: NodeRegion, name: str = "") -> str:
    """The checkpoint call's keyword arguments for ``region`` (see the module docstring)."""
    options = "" if _any_node(gm, region, "random") else ", preserve_rng_state=False"
    if _any_node(gm, region, "writes_saved"):
        options += ", early_stop=False"
    needs = []
    if region.policy == SAVE_COMPUTE:
        nodes = list(gm.graph.nodes)
        label = f"{name}: {nodes[region.first].name} .. {nodes[region.last].name}"
        needs.append(f'save="{Save.COMPUTE.value}", region={label!r}')
    if _any_node(gm, region, "mutates_state"):
        needs.append(_freeze(gm, region))
    if needs:
        options += f", {RUNTIME_CALL}self, {', '.join(needs)})"
    return options


def _named(gm: fx.GraphModule, regions: Sequence[NodeRegion], prefix: str = "ckpt") -> tuple[NodeRegion, ...]:
    out = []
    for i, r in enumerate(regions):
        name = f"{prefix}_{i}"
        out.append(replace(r, name=name, children=_named(gm, r.children, name),
                           options=region_options(gm, r, name) if r.options is None else r.options))
    return tuple(out)


def _input_check(gm: fx.GraphModule) -> tuple[str, ...]:
    contract: InputContract | None = getattr(gm, "remat_contract", None)
    if contract is None:
        return ()
    return (f"remat.runtime.check_inputs(self, {', '.join(contract.names)})",)


def _calls_runtime(regions: Sequence[NodeRegion]) -> bool:
    """Whether a region's checkpoint call passes ``remat.runtime.context(...)`` (the module then
    imports remat.runtime)."""
    return any(RUNTIME_CALL in (r.options or "") or _calls_runtime(r.children) for r in regions)


RUNTIME_CALL = "**remat.runtime.context("


def build(gm: fx.GraphModule, regions: Sequence[NodeRegion] = ()) -> RematModule:
    """A new module sharing ``gm``'s parameters whose forward checkpoints ``regions`` and runs each
    node under the modes it was traced under."""
    graph = copy.deepcopy(gm.graph)
    named = _named(gm, tuple(regions))
    prologue = _input_check(gm)
    uses_runtime = bool(prologue) or _calls_runtime(named)
    nester = Nester(Layout.of(graph, MODES_KEY), named, (("import remat.runtime",) if uses_runtime else ()) + prologue)
    graph.on_generate_code(lambda _: nester)
    new = RematModule(gm, graph, class_name=type(gm).__name__)
    for attr in _CARRIED:
        if hasattr(gm, attr):
            setattr(new, attr, getattr(gm, attr))
    return new


def generate(gm: fx.GraphModule, chain: Chain, regions: Sequence[Region]) -> RematModule:
    """``build`` for regions over the chain's stages."""
    regions = tuple(regions)
    validate_regions(regions, len(chain.stages))
    return build(gm, regions_from_stages(chain, regions))

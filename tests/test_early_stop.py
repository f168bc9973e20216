"""torch's checkpoint stops recomputing a region at the last tensor its forward saved (early stop):
the recomputation remat predicts is the one torch runs, counted independently by a fake step of
the generated module."""
import pytest
import torch

import remat
from remat.errors import InfeasibleBudget
from remat.profiler.flops import count_flops
from remat.zoo import build


def _mlp():
    torch.manual_seed(0)
    layers = [m for _ in range(6) for m in (torch.nn.Linear(256, 256), torch.nn.GELU())]
    return torch.nn.Sequential(*layers, torch.nn.Linear(256, 10)), (torch.randn(4096, 256),), {}


def _rrelu():
    """rrelu writes its noise into a tensor it does not return: its regions run without early stop."""
    torch.manual_seed(0)
    layers = [m for _ in range(4) for m in (torch.nn.Linear(256, 256), torch.nn.RReLU())]
    return torch.nn.Sequential(*layers, torch.nn.Linear(256, 10)), (torch.randn(2048, 256),), {}


def _zoo(spec: str, batch: int):
    def make():
        work = build(spec, batch)
        return work.model, work.inputs, work.kwargs
    return make


CASES = [  # a region ending in a linear reruns none of it (autograd saves its inputs first)
    ("mlp", _mlp, "every-stage", None), ("mlp", _mlp, "chen-sqrtn", None), ("mlp", _mlp, "rotor", 0.6),
    ("rrelu", _rrelu, "every-stage", None), ("rrelu", _rrelu, "chen-sqrtn", None),
    ("gpt2", _zoo("transformers:gpt2:layers=3,width=64,heads=4,seq=32", 2), "every-stage", None),
    ("gpt2", _zoo("transformers:gpt2:layers=3,width=64,heads=4,seq=32", 2), "chen-sqrtn", None),
    ("llama", _zoo("transformers:llama:layers=3,width=64,heads=4,seq=32,vocab=500", 2), "every-stage", None),
    ("llama", _zoo("transformers:llama:layers=3,width=64,heads=4,seq=32,vocab=500", 2), "rotor", 0.3),
    ("resnet18", _zoo("torchvision:resnet18", 2), "chen-sqrtn", None),
]


@pytest.mark.parametrize("name,make,solver,budget", CASES, ids=[f"{c[0]}-{c[2]}-{c[3]}" for c in CASES])
def test_predicted_recomputation_is_what_torch_runs_again(name, make, solver, budget):
    """The plan's recompute FLOPs equal the backward FLOPs the generated module adds to the
    model's (a stage of no FLOPs counts MIN_STAGE_FLOPS = 1: the few FLOPs of slack)."""
    if name in ("gpt2", "llama"):
        pytest.importorskip("transformers")
    if name == "resnet18":
        pytest.importorskip("torchvision")
    model, inputs, kwargs = make()
    try:
        gm = remat.checkpoint(model, inputs, kwargs, budget=budget, solver=solver)
    except InfeasibleBudget as e:  # pragma: no cover - the cases are chosen to plan
        pytest.fail(f"{name} {solver} {budget}: {e}")
    assert gm.remat_plan.regions, "a plan without regions tests nothing"
    measured = count_flops(gm, inputs, kwargs).bwd - count_flops(model, inputs, kwargs).bwd
    assert gm.remat_plan.recompute_flops == pytest.approx(measured, rel=1e-6, abs=64)


@pytest.mark.parametrize("seed", range(6))
def test_random_networks_recompute_what_the_plan_predicts(seed):
    """The same on random DAG networks of every op family the fuzzer draws (in-place ops, random
    ops, attention, convolutions; remat.testing.random_spec), with the chain cut everywhere it may
    be and into sqrt(n) segments."""
    import random
    from unittest import mock

    from remat.testing import FuzzNet, random_spec

    model = FuzzNet(random_spec(random.Random(seed), 10)).train()
    x = torch.randn(4, 8, 16, 16)
    # against the step with the model's own checkpoint calls (the fuzzer's "ckpt" op) run inline,
    # as a plan with regions runs them: their recomputation is not the plan's (a plan without
    # regions keeps them: against the model as it is)
    with mock.patch("torch.utils.checkpoint.checkpoint", lambda fn, *args, **_: fn(*args)):
        inline = count_flops(model, (x,)).bwd
    regions = 0
    for solver in ("every-stage", "chen-sqrtn"):
        gm = remat.checkpoint(model, (x,), solver=solver)
        regions += len(gm.remat_plan.regions)
        base = count_flops(model, (x,)).bwd if gm.remat_plan.info.user_checkpoints_kept else inline
        measured = count_flops(gm, (x,)).bwd - base
        assert gm.remat_plan.recompute_flops == pytest.approx(measured, rel=1e-6, abs=64), (seed, solver)
    assert regions, "no plan with regions: nothing tested"

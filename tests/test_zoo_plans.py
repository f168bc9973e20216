"""Refactoring guard: the plans remat makes for a fixed set of zoo models stay what they were.

Planned for ``device="cuda"`` on meta models, where op times come from the roofline of a fixed GPU
and memory from the rules, so the plans do not depend on this machine's timings (two fresh caches
give the same file).  A change that moves a region or a predicted byte shows here as a diff; when
the change is meant, regenerate with ``REMAT_UPDATE_GOLDEN=1`` and say why in the commit."""
import json
import os
from functools import cache
from pathlib import Path

import pytest

import remat
from remat.zoo import build

GOLDEN = Path(__file__).parent / "golden" / "zoo_plans.json"
MODELS = {"torchvision:resnet18": 8, "transformers:gpt2": 16, "transformers:llama": 16}
CASES = [(spec, solver, budget) for spec in MODELS
         for solver, budget in (("rotor", 0.8), ("chen-greedy", 0.8))]

pytestmark = pytest.mark.slow


@cache
def _workload(spec: str):
    return build(spec, MODELS[spec], meta_model=True)


def _region(r) -> list:
    return [r.start, r.stop, r.policy.value, [_region(c) for c in r.children]]


def _plan(spec: str, solver: str, budget: float) -> dict:
    work = _workload(spec)
    try:
        gm = remat.checkpoint(work.model, work.inputs, work.kwargs, budget=budget, solver=solver, device="cuda")
    except remat.InfeasibleBudget as e:
        return {"infeasible, floor": e.min_bytes}
    plan = gm.remat_plan
    return {"regions": [_region(r) for r in plan.regions], "predicted_peak_bytes": plan.predicted_peak_bytes,
            "budget_bytes": plan.budget_bytes}


@pytest.mark.parametrize("spec, solver, budget", CASES)
def test_zoo_plans_stay_the_same(spec, solver, budget, monkeypatch):
    for name in ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE", "TORCH_CUBLASLT_UNIFIED_WORKSPACE"):
        monkeypatch.delenv(name, raising=False)  # the GPU's workspace sizes (profiler/rules/cuda.py)
    key = f"{spec} {solver} {budget}"
    got = _plan(spec, solver, budget)
    golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    if os.environ.get("REMAT_UPDATE_GOLDEN"):
        golden[key] = got
        GOLDEN.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
    assert key in golden, f"no golden plan for {key}: run with REMAT_UPDATE_GOLDEN=1"
    assert got == golden[key]
    assert got.get("regions"), "a guard on plans with no region guards little"

"""Regions that keep matmul/conv/attention outputs (torch's selective checkpointing) must never keep
an output a later op overwrites: the recomputation would read the overwritten values.  GRUCell,
LSTMCell and RNNCell write their addmm outputs in place on the CPU (GRU's through ``unsafe_split``
chunks, which torch's own version check misses); so does user code (``y = lin(x); y.mul_(s)``)."""
import random
from dataclasses import replace

import pytest
import torch
from torch import nn

import remat
from remat.solvers.base import SAVE_COMPUTE, Region
from remat.chain import ChainModel
from remat.testing import ALL_OPS, INPLACE_OPS, FuzzNet, assert_same_step, random_spec
from remat.testing.patterns import CellChain
from remat.testing.plans import keeping_everywhere

CELLS = [nn.GRUCell, nn.LSTMCell, nn.RNNCell]


def _keeping_is_free(monkeypatch):
    """Make every selective region free, so the solver takes one wherever it may: whether they pay
    off otherwise depends on the op times measured on this machine."""
    seconds = ChainModel.recompute_seconds
    monkeypatch.setattr(ChainModel, "recompute_seconds",
                        lambda self, i, policy: 0.0 if policy == SAVE_COMPUTE else seconds(self, i, policy))


def _nodes(gm_or_profile):
    return {n.name: n for n in gm_or_profile.nodes}


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: c.__name__)
def test_the_profile_names_what_overwrites_a_kept_output(cell):
    torch.manual_seed(0)
    model, x = CellChain(cell, width=16, steps=3), torch.randn(4, 16)
    nodes = _nodes(remat.profile(model, (x,)))
    cells = [n for name, n in nodes.items() if name.startswith("cell")]
    assert len(cells) == 3
    for n in cells:
        assert "in place into the output of aten.addmm" in n.keep_refused, n
    # the linears around them keep their outputs safely
    assert nodes["inp"].keep_refused == "" and nodes["head"].keep_refused == ""


@pytest.mark.parametrize("op", ["lin_mul_", "conv_iadd", "conv_relu_", "lin_view_", "lin_unsafe_"])
def test_user_code_writing_a_matmul_output_refuses_keeping_it(op):
    """Directly, with +=, through a view and through an unsafe_split chunk."""
    from remat.testing.fuzz import Spec

    model, x = FuzzNet(Spec(((op, 0, 0), ("conv1", 1, 1)), (2,), 8, 0)), torch.randn(2, 8, 6, 6)
    refused = [n for n in remat.profile(model, (x,)).nodes if n.keep_refused]
    assert refused, "no node refuses keeping its overwritten output"
    # (not "linear": on a permuted map torch's linear runs mm, then adds the bias in place into it)
    plain = FuzzNet(Spec((("conv3", 0, 0), ("conv1", 1, 1), ("attn", 2, 2)), (3,), 8, 0))
    assert not [n for n in remat.profile(plain, (x,)).nodes if n.keep_refused]


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: c.__name__)
def test_rotor_keeps_no_output_a_cell_overwrites(monkeypatch, cell):
    """With selective regions free, rotor took them over the cells and trained with gradients up
    to several times off; now it keeps outputs only where nothing writes them, says why, and is exact."""
    _keeping_is_free(monkeypatch)
    torch.manual_seed(0)
    model, x = CellChain(cell, width=32, steps=8), torch.randn(16, 32)
    gm = assert_same_step(model, lambda m: remat.checkpoint(m, (x,), budget=0.5), (x,))
    plan = gm.remat_plan
    refused = {stage for stage, _ in plan.info["keep_refused"]}
    assert refused

    def walk(regions):
        for r in regions:
            if r.policy == SAVE_COMPUTE:
                assert not refused & set(range(r.start, r.stop)), r
            walk(r.children)

    walk(plan.regions)
    assert "no region keeps matmul/conv/attention outputs in" in plan.describe()
    assert remat.measure_peak(gm, (x,)) <= plan.budget_bytes


@pytest.mark.parametrize("cell", [nn.GRUCell, nn.LSTMCell], ids=lambda c: c.__name__)
@pytest.mark.parametrize("solver, budgets", [("rotor", (0.3, 0.5, 0.8, "min")),
                                             pytest.param("chen-greedy", (0.3, 0.5, 0.8, "min"), marks=pytest.mark.slow),
                                             ("chen-sqrtn", (None,)), ("every-stage", (None,))])
def test_cell_chains_train_exactly_at_every_solver_and_budget(cell, solver, budgets):
    torch.manual_seed(1)
    model, x = CellChain(cell, width=32, steps=12), torch.randn(16, 32)
    for budget in budgets:
        try:
            gm = assert_same_step(model, lambda m: remat.checkpoint(m, (x,), budget=budget, solver=solver), (x,))
        except remat.InfeasibleBudget as e:
            gm = assert_same_step(model, lambda m: remat.checkpoint(m, (x,), budget=e.min_bytes, solver=solver), (x,))
        if gm.remat_plan.budget_bytes is not None:
            assert remat.measure_peak(gm, (x,)) <= gm.remat_plan.budget_bytes, (solver, budget)


def test_a_hand_made_plan_keeping_an_overwritten_output_raises_instead_of_wrong_gradients():
    torch.manual_seed(0)
    model, x = CellChain(nn.GRUCell, width=32, steps=6), torch.randn(16, 32)
    plan = remat.checkpoint(model, (x,), budget=0.5).remat_plan
    n = len(plan.stages)
    keeping = replace(plan, regions=tuple(Region(i, min(i + 2, n), (), SAVE_COMPUTE) for i in range(0, n, 2)))
    gm = remat.apply_plan(model, (x,), keeping)
    assert 'save="compute", region=' in gm.code
    with pytest.raises(remat.KeptOutputOverwritten, match=r"ckpt_\d+: .* aten\.addmm.* writes into it in place"):
        gm(x).sum().backward()


def test_a_write_after_the_region_is_caught_by_the_version_check():
    """A kept output written after its region returned (torch's version counter sees it): the
    recomputation raises KeptOutputOverwritten naming the region, not a bare RuntimeError."""
    import torch.utils.checkpoint as cp

    from remat import runtime

    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    kept = []  # a handle on the addmm output the region keeps
    y = cp.checkpoint(lambda t: (kept.append(lin(t)), torch.tanh(kept[-1]))[1], x, use_reentrant=False,
                      **runtime.context(lin, save="compute", region="ckpt_1: test"))
    kept[0].mul_(2.0)  # written after the region, through the tensor itself
    with pytest.raises(remat.KeptOutputOverwritten, match="ckpt_1"):
        y.sum().backward()


@pytest.mark.parametrize("tied", [False, True], ids=["cast before the region", "weight used twice"])
def test_a_keeping_region_under_autocast_recomputes_the_casts_its_forward_made(tied):
    """Autocast casts a parameter once per outermost autocast block and reuses the cast: a region
    whose weight was cast before it (an earlier use, a tied weight, a planning step in the same
    block: accelerate's bf16 with checkpoint_) cast nothing in its forward and again in its
    recomputation, a fresh block, and torch's selective checkpoint, replaying the forward's op
    sequence, failed: "aten._to_copy ... encountered during backward but not found in storage"."""
    import torch.utils.checkpoint as cp

    from remat import runtime

    torch.manual_seed(0)
    lin, x = nn.Linear(8, 8), torch.randn(4, 8, requires_grad=True)

    def step(checkpointed: bool):
        lin.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = lin(x)  # casts lin.weight: the cast is cached for the rest of the block
            body = (lambda t: torch.tanh(lin(lin(t)) if tied else lin(t)))
            if checkpointed:
                out = cp.checkpoint(body, h, use_reentrant=False, **runtime.context(lin, save="compute", region="r"))
            else:
                out = body(h)
        out.float().sum().backward()
        return out.detach(), lin.weight.grad.clone()

    ref_out, ref_grad = step(False)
    out, grad = step(True)
    assert torch.is_autocast_cache_enabled()  # the region put the cache back
    torch.testing.assert_close(out, ref_out, atol=0, rtol=0)
    # with the cache the weight's uses share one bf16 cast, whose gradients are summed in bf16;
    # the region casts per use and sums in float32: equal to within two bf16 roundings
    torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=2**-7)


@pytest.mark.parametrize("seed", [0, 1, pytest.param(2, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow)])
def test_random_networks_with_inplace_writes_into_matmul_outputs(monkeypatch, seed):
    """The fuzz generator's new ops in random DAGs, selective regions free: every region the solver
    keeps outputs in is exact, and a hand-made plan keeping every stage it may is exact too."""
    _keeping_is_free(monkeypatch)
    rng = random.Random(seed)
    spec = random_spec(rng, 10, ops=ALL_OPS)
    while not any(op in INPLACE_OPS for op, _, _ in spec.ops):
        spec = random_spec(rng, 10, ops=ALL_OPS)
    model, x = FuzzNet(spec).train(), torch.randn(4, 8, 8, 8)
    try:
        gm = assert_same_step(model, lambda m: remat.checkpoint(m, (x,), budget=0.6), (x,))
    except remat.InfeasibleBudget as e:
        gm = assert_same_step(model, lambda m: remat.checkpoint(m, (x,), budget=e.min_bytes), (x,))
    assert remat.measure_peak(gm, (x,)) <= gm.remat_plan.budget_bytes
    assert_same_step(model, lambda m: keeping_everywhere(m, (x,)), (x,))


@pytest.mark.parametrize("per_op", [0.0, 1.0])
def test_keeping_regions_pay_for_torchs_selective_dispatch(monkeypatch, per_op):
    """torch's selective checkpoint runs every op of a region through a Python dispatch mode, in the
    forward and the recomputation (timing.py measures it: ~10 us per op here, most of what keeping a
    Llama layer's outputs costs).  The plan pays for it: priced at a second per op, rotor keeps no
    outputs anywhere; free, it keeps a small Llama's matmul outputs (an MLP's regions no longer
    serve: plain regions over its norms and activations drop as much for the same recomputation).

    The op times come from fixed machine numbers by the roofline (no kernel timed): which regions
    keep outputs follows the op times, and op times measured on a busy CI machine once made the free
    case keep nothing.  Matmul rates from 50 GFLOP/s to 1 TFLOP/s give the same kinds of regions."""
    import remat.planner.search
    import remat.profiler.model
    from remat.profiler.timing import Machine, machine
    from remat.zoo import build

    pytest.importorskip("transformers")
    assert machine("cpu", 1).selective_op_s > 0  # measured on this machine
    fixed = Machine(100e9, 10e9, 5e-6, "a 2-core CPU's order of magnitude", selective_op_s=per_op)
    monkeypatch.setattr(remat.profiler.model, "machine", lambda *a: fixed)
    # the DP's pricing at the budget's limit, not the search's looser rounds (planner/search.py)
    monkeypatch.setattr(remat.planner.search, "LOOSEN_ROUNDS", 0)
    work = build("transformers:llama:layers=2,width=256,heads=4,seq=256,vocab=1000", 2)
    gm = remat.checkpoint(work.model, work.inputs, work.kwargs, budget=0.7, calibrate=False)
    kinds = {str(r.policy) for r in gm.remat_plan.regions}
    assert gm.remat_plan.regions and (("save-compute" in kinds) == (per_op == 0.0)), kinds

"""Solvers: rotor's optimality, Chen's plans, budget parsing, verified plans, plans as data."""
import math
import random
from dataclasses import replace

import pytest
import torch

import remat
from remat.budget import parse_budget
from remat.chain import ChainModel
from remat.chain.costs import SkipPart
from remat.solvers.base import SAVE_COMPUTE, Plan, Region
from remat.solvers.chen import greedy_regions
from remat.solvers.model import evaluate
from remat.solvers.rotor import _nests_selective, rotor_plan, rotor_regions, solve_rotor, solve_table
from remat.zoo import ResidualMLP

from remat.testing import assert_same_step


def random_model(n: int, rng: random.Random) -> ChainModel:
    """A random chain with random residual blocks (a stage's output flowing over later cuts)."""
    f = [rng.randint(1, 100) for _ in range(n)]
    y = [rng.randint(1, 50) for _ in range(n)]
    skip, skip_from = [0] * n, [-1] * n
    i = 0
    while i < n - 1:
        if rng.random() < 0.5:
            b0, length = i, rng.randint(1, 3)
            for j in range(b0 + 1, min(n - 1, b0 + 1 + length)):
                skip[j], skip_from[j] = y[b0], b0
            i = b0 + 1 + length
        else:
            i += 1
    x = [0] + [y[i] + skip[i] for i in range(n - 1)]
    xbar = [y[i] + rng.randint(0, 80) for i in range(n)]
    # what a region keeping its expensive outputs keeps of each stage, and the time that skips
    keep = [rng.randint(0, xbar[i]) if rng.random() < 0.7 else 0 for i in range(n)]
    keep_time = [float(rng.randint(0, f[i])) for i in range(n)]
    # a stage's forward with nothing saved: mostly its output and a little, at times a large transient
    # (a region's forward, not its recomputation, is then what bounds it)
    fdis = [y[i] + (rng.randint(0, 40) if rng.random() < 0.7 else rng.randint(40, 250)) for i in range(n)]
    # input a region starting at the stage holds though nothing saves it (an add's, a dropout's input)
    xfree = [rng.randint(0, x[i]) if rng.random() < 0.5 else 0 for i in range(n)]
    model = ChainModel(tuple(f), tuple(x), tuple(y), tuple(xbar),
                       tuple(rng.randint(0, 20) for _ in range(n)), tuple(rng.randint(0, 30) for _ in range(n)),
                       tuple(rng.randint(0, 10) for _ in range(n)), tuple(fdis),
                       fwd_time=tuple(float(v) for v in f), keep_bytes=tuple(keep), keep_time=tuple(keep_time),
                       xfree=tuple(xfree))
    # stages whose kept outputs a later op overwrites (no selective region may hold them), drawn
    # from the model itself so the draws after this one (the limits) stay those of earlier seeds
    unsafe = random.Random(hash((model.fwd_flops, model.xbar)))
    refused = tuple("" if unsafe.random() < 0.8 else "overwritten" for _ in range(n))
    # the forward after each stage's last save (torch's early stop does not rerun it at a region's
    # end): none, all (a stage ending in a matmul, whose inputs autograd saves first) or some
    tails = random.Random(hash((model.fwd_flops, model.x)))
    tail = tuple(float(tails.choice([0, f[i], tails.randint(0, f[i])])) for i in range(n))
    # the output no node saves (a region ending at the stage does not hold it): none, all or some
    frees = random.Random(hash((model.fwd_flops, model.y)))
    y_free = tuple(frees.choice([0, y[i], frees.randint(0, y[i])]) for i in range(n))
    skip_free = tuple(frees.choice([0, skip[i], frees.randint(0, skip[i])]) for i in range(n))
    # what only later stages save of its xbar, released after their backward
    ylate = tuple(frees.choice([0, min(y[i], xbar[i]), frees.randint(0, min(y[i], xbar[i]))]) for i in range(n))
    parts = tuple((SkipPart(skip_from[i], skip[i], skip_free[i]),) if skip[i] else () for i in range(n))
    model = replace(model, keep_refused=refused, tail_time=tail, y_free=y_free, skip_parts=parts, ylate=ylate)
    return _more_columns(model, random.Random(hash((model.fwd_flops, model.xbar, 1))))


def _more_columns(m: ChainModel, rng: random.Random) -> ChainModel:
    """Draws of the columns that make the stage model exact on real steps: gradients only of what
    requires grad, and new only for what a stage reads (grad_in, grad_new); a region's kept outputs
    that are its output (y_keep, skip parts' keep); skip values from several producers; the inputs a
    region holds by the stage that reads them (xfree_parts); kept outputs after the last save
    (tail_keep); a stashed RNG state (rng_state).  From their own stream: earlier draws unchanged."""
    n = len(m)
    pick = lambda hi: rng.choice([hi, rng.randint(0, hi), 0]) if hi > 0 else 0  # noqa: E731
    grad_in = tuple(rng.choice([m.x[i], rng.randint(0, m.x[i])]) for i in range(n))
    grad_new = tuple(rng.choice([g, rng.randint(0, g)]) for g in grad_in)
    y_keep = tuple(pick(min(m.keep_bytes[i], m.y[i] - m.y_free[i])) for i in range(n))
    parts = []
    for i in range(n):
        if not m.skip(i):
            parts.append(())
            continue
        (block,) = m.parts(i)  # one part: the block's input
        older = rng.randint(0, block.bytes) if rng.random() < 0.5 else 0  # a value made before the block
        split = [(block.producer, block.bytes - older), (rng.randint(-1, max(-1, block.producer - 1)), older)]
        parts.append(tuple(SkipPart(p, b, free, pick(b - free))
                           for p, b in split if b for free in [pick(b)]))
    xfree_parts = tuple(tuple((rng.randint(s, n - 1), b) for b in _split(m.xfree[s], rng) if b) for s in range(n))
    return replace(m, grad_in=grad_in, grad_new=grad_new, y_keep=y_keep, skip_parts=tuple(parts),
                   xfree_parts=xfree_parts, tail_keep=tuple(pick(k) for k in m.keep_bytes),
                   rng_state=tuple(rng.choice([0, 0, rng.randint(1, 20)]) for _ in range(n)))


def _split(total: int, rng: random.Random) -> list[int]:
    """``total`` in one or two random parts."""
    cut = rng.randint(0, total) if rng.random() < 0.5 else total
    return [cut, total - cut]


def all_structures(start, stop, forbid=None, safe=None, selective=True):
    """Every ordered list of disjoint regions in [start, stop), nested arbitrarily deep; a region
    with nothing inside also in its variant that keeps the expensive outputs, where every stage in
    it may be kept (``safe``: per stage; None: all), but not inside a plain region (rotor's plan
    space: torch holds a nested selective region's keeps through the outer forward, model.py)."""
    if start >= stop:
        yield []
        return
    yield from all_structures(start + 1, stop, forbid, safe, selective)
    for end in range(start + 1, stop + 1):
        if (start, end) == forbid:
            continue
        for inner in all_structures(start, end, (start, end), safe, selective=False):
            for rest in all_structures(end, stop, forbid, safe, selective):
                yield [Region(start, end, tuple(inner))] + rest
                if selective and not inner and (safe is None or all(safe[start:end])):
                    yield [Region(start, end, (), SAVE_COMPUTE)] + rest


def exact_search(model: ChainModel, limits) -> dict[int, float | None]:
    """Least recomputation at each limit over every nested plan, each evaluated by the model's
    simulator (the plans are enumerated once; each limit then costs a scan)."""
    costs = [evaluate(model, regions) for regions in all_structures(0, len(model), safe=model.keep_safe)]
    return {limit: min((c.recompute for c in costs if c.peak <= limit), default=None) for limit in limits}


# Seeds 0-7 and 10 run by default (10 caught a DP that skipped a kept stage's backward memory check);
# six-stage chains enumerate ~400k plans each, so the other seeds run with the slow ones.
@pytest.mark.parametrize("seed", [*range(8), 10, *(pytest.param(s, marks=pytest.mark.slow) for s in (8, 9, *range(11, 40)))])
def test_rotor_is_optimal_against_exhaustive_search(seed):
    rng = random.Random(seed)
    model = random_model(rng.randint(1, 6), rng)
    top = evaluate(model, ()).peak
    # limits down to a quarter of the unconstrained peak: the tightest ones bind the memory checks
    # of the regions that keep their expensive outputs
    limits = sorted({rng.randint(top // 4, top) for _ in range(8)} | {top})
    exact = exact_search(model, limits)
    for limit in limits:
        table = solve_table(model, limit, slots=limit)  # one byte per slot: no rounding
        regions = rotor_regions(table)
        best = exact[limit]
        if regions is None:
            assert best is None
            continue
        cost = evaluate(model, regions)
        assert cost.peak <= limit
        assert cost.recompute == pytest.approx(float(table.cost[0, len(model) - 1, limit]) - sum(model.fwd_time))
        assert cost.recompute == pytest.approx(best)


# The first half runs by default: without the selective-forward check in rotor.py, seeds 1012,
# 1017, 1038, 1045, 1051, 1060 and 1067 fail there (and 1082, 1103, 1130, 1132 in the slow half).
@pytest.mark.parametrize("seeds", [range(1000, 1075), pytest.param(range(1075, 1150), marks=pytest.mark.slow)],
                         ids=["1000-1074", "1075-1149"])
def test_rotor_is_optimal_on_many_short_chains(seeds):
    """The same property on 150 chains of 2-4 stages, where exhaustive search is cheap: more draws
    of the limits that bind each memory check (a selective region's forward with its keeps once
    went unchecked here, unnoticed by the seeds above).  rotor_plan, which solves one table that
    admits selective regions inside plain ones and falls back to two when its plan nests one, must
    find the same optimum."""
    for seed in seeds:
        rng = random.Random(seed)
        model = random_model(rng.randint(2, 4), rng)
        top = evaluate(model, ()).peak
        limits = sorted({rng.randint(top // 4, top) for _ in range(6)})
        exact = exact_search(model, limits)
        for limit in limits:
            for regions in (rotor_regions(solve_table(model, limit, slots=limit)), rotor_plan(model, limit, slots=limit)):
                if regions is None:
                    assert exact[limit] is None, (seed, limit)
                    continue
                cost = evaluate(model, regions)
                assert cost.peak <= limit, (seed, limit)
                assert cost.recompute == pytest.approx(exact[limit]), (seed, limit)


def test_rotor_charges_early_stop_at_most_what_it_saves_where_stages_save_nothing():
    """A region's recomputation stops at its last save (model.py).  Where its last stages save
    nothing (a residual add) or a stage turns early stop off (rrelu), the DP's charge is a bound:
    never below what the simulator counts for its plan, itself never below the exhaustive optimum."""
    checked = 0
    for seed in range(300):
        rng = random.Random(seed)
        n = rng.randint(2, 5)
        model = random_model(n, rng)
        saves = tuple(rng.random() < 0.6 for _ in range(n))
        model = replace(model, saves=saves, early_stop=tuple(rng.random() < 0.9 for _ in range(n)),
                        tail_time=tuple(t if s else f for t, s, f in zip(model.tail_time, saves, model.fwd_time)))
        top = evaluate(model, ()).peak
        for limit in sorted({rng.randint(top // 4, top) for _ in range(3)}):
            table = solve_table(model, limit, slots=limit, nested=True)
            regions = rotor_regions(table)
            if regions is None or _nests_selective(regions):
                continue
            cost = evaluate(model, regions)
            charged = float(table.cost[0, n - 1, limit]) - sum(model.fwd_time)
            assert cost.recompute <= charged + 1e-3, (seed, limit, regions)
            best = exact_search(model, [limit])[limit]
            assert best is not None and best <= cost.recompute + 1e-9
            checked += 1
    assert checked > 100, checked


def test_rotor_plan_falls_back_to_two_tables_when_the_relaxed_plan_nests():
    """Where the one-table solve's plan nests a selective region in a plain one (undercharged),
    rotor_plan's answer is the two-table optimum, checked against exhaustive search; five such
    cases among the short chains, or the fallback goes untested."""
    found = 0
    for seed in range(1000, 3000):
        rng = random.Random(seed)
        model = random_model(rng.randint(2, 5), rng)
        top = evaluate(model, ()).peak
        for limit in sorted({rng.randint(top // 4, top) for _ in range(6)}):
            relaxed = rotor_regions(solve_table(model, limit, slots=limit, nested=True))
            if relaxed is None or not _nests_selective(relaxed):
                continue
            regions = rotor_plan(model, limit, slots=limit)
            assert not _nests_selective(regions or ())
            cost = evaluate(model, regions) if regions is not None else None
            best = exact_search(model, [limit])[limit]
            assert (cost.recompute if cost is not None and cost.peak <= limit else None) == pytest.approx(best)
            found += 1
        if found >= 5:
            break
    assert found >= 5, found


def random_plans(n: int, rng: random.Random, count: int):
    """Random nested plans, for chains too long to enumerate (10 stages: 211 million plans)."""
    def build(start, stop, depth):
        out, i = [], start
        while i < stop:
            if rng.random() < 0.4 and depth < 3:
                end = rng.randint(i + 1, stop)
                out.append(Region(i, end, tuple(build(i, end, depth + 1)) if end - i > 1 else ()))
                i = end
            else:
                i += 1
        return out
    return [build(0, n, 0) for _ in range(count)]


def test_a_value_every_block_reads_is_counted_once_and_rotor_plans_stay_under_the_limit():
    """A value no node saves and every block reads (a causal mask: ChainModel.pinned) is held by
    each region over a reader until that region's backward; the simulator counts it once, to the
    first such region's backward (or its last reader's forward): never more than its bytes above
    the same chain without it.  rotor counts it for the whole step, so its plans stay under the limit
    in the simulator and recompute at least the exhaustive optimum."""
    checked = 0
    for seed in range(150):
        rng = random.Random(seed)
        n = rng.randint(3, 5)
        base = random_model(n, rng)
        p = rng.randint(0, n - 2)
        readers = tuple(sorted(rng.sample(range(p + 1, n), rng.randint(1, n - 1 - p))))
        pinned = [0] * n
        pinned[p] = rng.randint(1, 60)
        model = replace(base, pinned=tuple(pinned), pinned_readers=tuple(readers if i == p else () for i in range(n)))
        for regions in random_plans(n, rng, 20):
            extra = evaluate(model, regions).peak - evaluate(base, regions).peak
            assert 0 <= extra <= pinned[p], (seed, regions)
        top = evaluate(model, ()).peak
        for limit in sorted({rng.randint(top // 3, top) for _ in range(3)}):
            regions = rotor_plan(model, limit, slots=limit)
            if regions is None:
                continue
            cost = evaluate(model, regions)
            assert cost.peak <= limit, (seed, limit, regions)
            if n <= 4:  # (five stages enumerate ~20k plans)
                best = exact_search(model, [limit])[limit]
                assert best is not None and best <= cost.recompute + 1e-9
            checked += 1
    assert checked > 150, checked


@pytest.mark.parametrize("seed", range(6))
def test_rotor_beats_every_sampled_plan_on_ten_stages(seed):
    rng = random.Random(100 + seed)
    model = random_model(10, rng)
    top = evaluate(model, ()).peak
    limit = rng.randint(top // 2, top)
    table = solve_table(model, limit, slots=limit)
    regions = rotor_regions(table)
    cost = evaluate(model, regions) if regions is not None else None
    for plan in random_plans(10, rng, 3000):
        c = evaluate(model, plan)
        if c.peak <= limit:
            assert cost is not None and cost.recompute <= c.recompute, (plan, c, cost)


def _expand(regions, groups):
    return tuple(Region(groups[r.start][0], groups[r.stop - 1][1], _expand(r.children, groups), r.policy)
                 for r in regions)


@pytest.mark.parametrize("seed", range(6))
def test_merged_stages_bound_the_chain_and_are_exact_when_kept(seed):
    """The planner solves on merged stages (coarsen): every plan there must cost at least what it
    costs on the stages it merges, and keeping everything must cost exactly the same (bounds by
    sums and maxima once hid 50 MiB of GPT-2's floor)."""
    rng = random.Random(300 + seed)
    model = random_model(14, rng)
    cuts = sorted(rng.sample(range(1, 14), rng.randint(2, 8)))
    groups = list(zip([0, *cuts], [*cuts, 14]))
    merged = model.merged(groups)
    assert evaluate(merged, ()).peak == evaluate(model, ()).peak
    for plan in random_plans(len(groups), rng, 300):
        if rng.random() < 0.3:
            plan = [Region(r.start, r.stop, (), SAVE_COMPUTE) for r in plan]
        assert evaluate(merged, plan).peak >= evaluate(model, _expand(tuple(plan), groups)).peak, plan


def test_discretized_rotor_plans_fit_and_are_not_worse_than_greedy():
    rng = random.Random(7)
    for _ in range(20):
        model = random_model(rng.randint(3, 30), rng)
        top = evaluate(model, ()).peak
        for limit in (top // 2, (2 * top) // 3, top):
            regions = solve_rotor(model, limit, 500)
            greedy = greedy_regions(model, limit)
            if greedy is not None:
                assert regions is not None
                assert evaluate(model, regions).recompute <= evaluate(model, greedy).recompute
            if regions is not None:
                assert evaluate(model, regions).peak <= limit


@pytest.mark.parametrize("text, expected", [("50%", 0.5), ("0.25", 0.25), (0.75, 0.75), (1.0, 1.0)])
def test_budget_fractions(text, expected):
    assert parse_budget(text).fraction == pytest.approx(expected)
    assert parse_budget(text).resolve(100, 300) == int(100 + expected * 200)


@pytest.mark.parametrize("text, expected", [("1.5GiB", int(1.5 * 2**30)), ("800MB", 800_000_000), (123456, 123456),
                                            ("4096", 4096)])
def test_budget_bytes(text, expected):
    assert parse_budget(text).bytes == expected


@pytest.mark.parametrize("bad, message", [(-5, "positive"), (0, "positive"), (0.0, r"\(0, 1\]"), (1.5, r"\(0, 1\]"),
                                          (float("nan"), "finite"), ("lots", "cannot parse"), ("-1GB", "cannot parse"),
                                          ("150%", r"\(0, 1\]"), (True, "budget must be"), ("nan", "finite")])
def test_bad_budgets_are_value_errors(bad, message):
    with pytest.raises(ValueError, match=message):
        parse_budget(bad)
    with pytest.raises(ValueError, match=message):
        remat.checkpoint(torch.nn.Linear(4, 4), (torch.randn(2, 4),), budget=bad)


@pytest.mark.parametrize("solver", ["rotor", "chen-greedy"])
def test_infeasible_budget_names_a_minimum_that_fits(solver):
    """The reported floor is itself a budget the solver plans under, verified and measured."""
    model = ResidualMLP(width=64, depth=4)
    x = torch.randn(64, 32, 64)
    with pytest.raises(remat.InfeasibleBudget, match=r"smallest feasible budget is (\d+) bytes") as info:
        remat.checkpoint(model, (x,), budget=0.01, solver=solver)
    floor = info.value.min_bytes
    assert floor > 0 and 0 < info.value.min_fraction < 1
    assert str(floor) in str(info.value)
    gm = remat.checkpoint(model, (x,), budget=floor, solver=solver)
    assert gm.remat_plan.predicted_peak_bytes <= floor
    assert remat.measure_peak(gm, (x,)) <= floor
    with pytest.raises(remat.InfeasibleBudget):
        remat.checkpoint(model, (x,), budget=int(floor * 0.99), solver=solver)


def test_a_fixed_plan_over_the_budget_says_what_it_needs():
    model = ResidualMLP(width=64, depth=4)
    x = torch.randn(64, 32, 64)
    with pytest.raises(remat.InfeasibleBudget, match="every-stage plan does not fit") as info:
        remat.checkpoint(model, (x,), budget=0.01, solver="every-stage")
    gm = remat.checkpoint(model, (x,), budget=info.value.min_bytes, solver="every-stage")
    assert gm.remat_plan.predicted_peak_bytes <= info.value.min_bytes


@pytest.mark.parametrize("solver", ["rotor", "chen-greedy"])
def test_budgeted_plans_fit_measured_and_train_exactly(solver):
    model = ResidualMLP(width=128, depth=6)
    x = torch.randn(8, 64, 128)
    gm = assert_same_step(model, lambda m: remat.checkpoint(m, (x,), budget=0.5, solver=solver), (x,))
    plan = gm.remat_plan
    assert plan.solver == solver and plan.regions
    assert remat.measure_peak(gm, (x,)) <= plan.budget_bytes


def test_a_plan_the_stage_model_over_predicts_uses_the_budget_it_leaves(monkeypatch):
    """The DP's table rounds sizes up to slots (and the stage model is a bound), so a plan can fit
    with budget to spare; the planner raises the solver's limit while the verified plan still
    fits, and the plan it then returns recomputes less, fits measured and trains exactly (a small
    Llama at 0.6: 0.94 -> 0.79 ms predicted; at 0.45, where the stage model over-predicted by
    its mask and residual gradients before they were counted once, it now finds the plan at once)."""
    import remat.planner.search as search
    from remat.zoo import build

    work = build("transformers:llama:layers=4,width=128,heads=4,seq=128,vocab=1000", 2)

    def plan(rounds: int, model=work.model):
        monkeypatch.setattr(search, "LOOSEN_ROUNDS", rounds)
        return remat.checkpoint(model, work.inputs, work.kwargs, budget=0.6)

    tight = plan(0).remat_plan
    loose = assert_same_step(work.model, lambda m: plan(3, m), work.inputs, kwargs=work.kwargs)
    got = loose.remat_plan
    assert got.budget_bytes == tight.budget_bytes
    assert got.info.recompute_seconds < tight.info.recompute_seconds
    assert tight.predicted_peak_bytes < got.predicted_peak_bytes <= got.budget_bytes
    # the time side's bound is the loosened plan's: no plan the search found recomputes less
    assert got.info.best_recompute_seconds == got.info.recompute_seconds
    assert remat.measure_peak(loose, work.inputs, work.kwargs) <= got.budget_bytes


def test_recompute_never_grows_with_the_budget():
    """What rotor minimizes, the predicted recompute time, never grows with the budget (FLOPs may:
    a memory-bound op can cost more time per FLOP than a matmul)."""
    from remat.cli.sweep import sweep

    rows = sweep(ResidualMLP(width=128, depth=8), (torch.randn(8, 64, 128),), points=6, solvers=("rotor",))
    feasible = [r for r in rows if r.peak_bytes is not None]
    assert len(feasible) >= 4
    for a, b in zip(feasible, feasible[1:]):
        assert b.budget_bytes >= a.budget_bytes
        assert b.recompute_seconds <= a.recompute_seconds * (1 + 1e-9)
        assert a.peak_bytes <= a.budget_bytes


def test_plan_round_trips_through_json_and_reapplies(tmp_path):
    model, inputs = ResidualMLP(width=64, depth=6), (torch.randn(4, 64, 64),)
    gm = remat.checkpoint(model, inputs, budget="40%")
    assert gm.remat_plan.regions  # a plan that changes the code, so reapplying it is tested
    path = tmp_path / "plan.json"
    gm.remat_plan.to_json(path)
    plan = remat.load_plan(path)
    assert plan == Plan.from_json(gm.remat_plan.to_json())
    again = assert_same_step(model, lambda m: remat.apply_plan(m, inputs, plan), inputs)
    assert again.code == gm.code
    with pytest.raises(ValueError, match="different graph"):
        remat.apply_plan(ResidualMLP(width=64, depth=3), inputs, plan)


@pytest.mark.slow
def test_resnet50_rotor_fits_at_budget_0_3_and_trains_exactly():
    torchvision = pytest.importorskip("torchvision")
    model = torchvision.models.resnet50()
    x = torch.randn(4, 3, 224, 224)
    gm = assert_same_step(model, lambda m: remat.checkpoint(m, (x,), budget=0.3), (x,))
    assert remat.measure_peak(gm, (x,)) <= gm.remat_plan.budget_bytes
    assert math.isclose(gm.remat_plan.budget_bytes,
                        gm.remat_plan.info["fixed_bytes"] + 0.3 * (gm.remat_plan.info["unconstrained_peak_bytes"]
                                                                   - gm.remat_plan.info["fixed_bytes"]), rel_tol=1e-6)


@pytest.mark.parametrize("solver", ["rotor", "chen-greedy"])
def test_budget_one_checkpoints_nothing(solver):
    model, x = ResidualMLP(width=64, depth=4), torch.randn(8, 32, 64)
    gm = remat.checkpoint(model, (x,), budget=1.0, solver=solver)
    assert gm.remat_plan.regions == () and gm.remat_plan.recompute_flops == 0


def test_regions_over_merged_stages_keep_their_policy_and_nesting():
    """The planner solves on merged stages and expands the regions back: a region that keeps its
    expensive outputs must stay one (it once came back as a plain region, so no plan ever used
    torch's selective checkpoint)."""
    from remat.planner.search import _expand

    groups = [(0, 2), (2, 3), (3, 7), (7, 9)]
    coarse = (Region(0, 2, (Region(1, 2),)), Region(2, 4, (), SAVE_COMPUTE))
    assert _expand(coarse, groups) == (Region(0, 3, (Region(2, 3),)), Region(3, 9, (), SAVE_COMPUTE))


def test_a_selective_plan_torch_cannot_replay_is_planned_again_without_selective_regions(monkeypatch):
    """torch's selective checkpoint refuses a recomputation whose ops differ from the forward's; the
    simulation sees it first, and the planner falls back to plain regions with a warning instead of
    raising (or returning a module that fails in its first backward)."""
    import warnings

    from remat.planner.problem import Problem
    from remat.testing import assert_same_step
    from remat.zoo import ResidualMLP

    torch.manual_seed(0)
    model, inputs = ResidualMLP(width=128, depth=4, classes=1, p=0.1), (torch.randn(8, 64, 128),)
    # the case under test: a plan with selective regions (made free here: whether they pay off
    # depends on the op times measured on this machine)
    seconds = ChainModel.recompute_seconds
    monkeypatch.setattr(ChainModel, "recompute_seconds",
                        lambda self, i, policy: 0.0 if policy == SAVE_COMPUTE else seconds(self, i, policy))
    budget = 0.9
    assert 'save="compute"' in remat.checkpoint(model, inputs, budget=budget).code

    real = Problem.predict

    def refuse(self, gm):
        if 'save="compute"' in gm.code:
            raise RuntimeError("aten.add.Tensor encountered during backward but not found in storage")
        return real(self, gm)

    monkeypatch.setattr(Problem, "predict", refuse)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gm = assert_same_step(model, lambda m: remat.checkpoint(m, inputs, budget=budget), inputs)
    assert any(issubclass(w.category, remat.RematWarning) and "selective" in str(w.message) for w in caught)
    assert gm.remat_plan.regions and 'save="compute"' not in gm.code
    assert remat.measure_peak(gm, inputs) <= gm.remat_plan.budget_bytes


def test_regions_are_named_by_the_modules_they_cover():
    """describe() named regions of torch.export traces by fx nodes ("_assert_tensor_metadata_default_3
    .. mul_4"); both frontends record each op's module, and regions are shown by the blocks they cover."""
    from remat.zoo import build

    for spec, budget, prefix in (("mlp", 0.4, "blocks."), ("transformers:gpt2:layers=3,width=64,heads=2,seq=64", "min",
                                                         "transformer.h.")):
        work = build(spec, 2)
        plan = remat.checkpoint(work.model, work.inputs, work.kwargs, budget=budget).remat_plan
        lines = [line for line in plan.describe().splitlines() if "- checkpoint stages" in line]
        assert lines and all(": " in line for line in lines)
        assert any(prefix in line.split(": ", 1)[1] for line in lines), lines
        assert not any("_assert_tensor_metadata" in line or "sym_size" in line for line in lines), lines

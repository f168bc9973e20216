"""Memory over the step: the timeline data, its picture, and the sweep's Pareto plot."""
import copy
import pickle

import pytest
import torch

import remat
from remat.profiler.step import simulate_step
from remat.cli.sweep import Sweep, SweepRow, pareto_figure
from remat.timeline import draw_timeline, plan_timeline, step_timeline
from remat.zoo import ResidualMLP


@pytest.fixture(scope="module")
def planned():
    torch.manual_seed(0)
    model = ResidualMLP(width=64, depth=4)
    x = torch.randn(4, 128, 64)
    return model, x, remat.checkpoint(model, (x,), budget=0.6)


def test_the_timeline_peaks_where_the_prediction_does(planned):
    model, x, gm = planned
    for module in (model, gm):
        line = step_timeline(module, (x,))
        assert line.peak == simulate_step(module, (x,)).peak
        assert [p.index for p in line.points] == list(range(len(line.points)))
        start = line.backward_start
        assert start is not None and {p.phase for p in line.points[:start]} == {"fwd"}
        assert {p.phase for p in line.points[start:]} == {"bwd"}
        assert all(p.bytes >= p.after >= line.resident for p in line.points)
    assert step_timeline(model, (x.to("meta"),)).peak == step_timeline(model, (x,)).peak  # no data needed


def test_the_plans_timeline_marks_its_regions_and_recomputation(planned):
    model, x, gm = planned
    plan = gm.remat_plan
    data = plan_timeline(model, gm, (x,))
    assert data.original.peak == plan.info["unconstrained_peak_bytes"]
    assert data.planned.peak == plan.predicted_peak_bytes <= plan.budget_bytes == data.budget_bytes
    assert data.original.spans == []  # the model has no checkpoint of its own
    first_runs = [s for s in data.planned.spans if s.phase == "fwd"]
    reruns = [s for s in data.planned.spans if s.phase == "recompute"]
    assert len(first_runs) == gm.code.count("torch.utils.checkpoint.checkpoint(") and reruns
    start = data.planned.backward_start
    assert all(s.last < start for s in first_runs) and all(s.first >= start for s in reruns)
    assert len(data.planned.points) > len(data.original.points)  # recomputation adds ops


def test_a_plan_read_from_json_has_the_same_timeline(planned):
    """The plan is data: a plan saved and applied again draws the same timeline, and the plan
    itself holds no model (copies and pickles carry only its fields)."""
    model, x, gm = planned
    again = remat.apply_plan(model, (x,), remat.Plan.from_json(gm.remat_plan.to_json()))
    first, second = plan_timeline(model, gm, (x,)), plan_timeline(model, again, (x,))
    assert second.planned.peak == first.planned.peak and second.budget_bytes == first.budget_bytes
    assert [p.bytes for p in second.planned.points] == [p.bytes for p in first.planned.points]
    assert set(vars(copy.deepcopy(gm.remat_plan))) == set(vars(pickle.loads(pickle.dumps(gm)).remat_plan))
    with pytest.raises(ValueError, match="remat_plan"):
        plan_timeline(model, model, (x,))


def test_the_timeline_picture(planned, tmp_path):
    pytest.importorskip("matplotlib")
    model, x, gm = planned
    png = tmp_path / "mem.png"
    data = plan_timeline(model, gm, (x,))
    draw_timeline(data, str(png), title="mlp", measured=remat.measure.measure_series(gm, (x,)))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_measured_series_peaks_at_the_measured_peak(planned):
    _, x, gm = planned
    from remat.measure import measure_series

    curve = measure_series(gm, (x,))
    assert max(curve) == remat.measure_peak(gm, (x,))
    assert curve[0] == min(curve)  # starts at the resident bytes


def test_the_pareto_plot_keeps_none_on_top_and_draws_the_bounds():
    pytest.importorskip("matplotlib")
    mib = 2**20
    rows = [SweepRow("rotor", 0.2, 110 * mib, 108 * mib, 0.30, 3, measured_bytes=107 * mib),
            SweepRow("rotor", 0.1, 105 * mib, None, None, 0, min_bytes=108 * mib),
            SweepRow("chen-greedy", 0.2, 110 * mib, 109 * mib, 0.35, 2),
            SweepRow("none", None, None, 150 * mib, 0.0, 0),
            SweepRow("every-stage", None, None, 120 * mib, 1.0, 9)]
    result = Sweep(rows, fixed_bytes=100 * mib, unconstrained_bytes=150 * mib)
    assert result.floor_bytes == 108 * mib and list(result) == rows
    fig = pareto_figure(result, "t", budget_bytes=130 * mib)
    ax = fig.axes[0]
    data = [line for line in ax.get_lines() if line.get_label() in {"rotor", "chen-greedy", "none", "every-stage"}]
    assert data[-1].get_label() == "none" and data[-1].get_zorder() > max(d.get_zorder() for d in data[:-1])
    labels = [line.get_label() for line in ax.get_lines()]
    assert "rotor, measured" in labels
    assert any(label.startswith("budget: 130.00 MiB") for label in labels)
    assert any(label.startswith("rotor's smallest budget: 108.00 MiB") for label in labels)
    assert any(label.startswith("fixed") for label in labels)


@pytest.mark.slow
def test_plan_draws_the_timeline_with_the_measured_curve(run_remat, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "mem.png"
    done = run_remat("plan", "mlp", "--batch", "2", "--budget", "50%", "--measure", "--timeline", str(png))
    assert done.returncode == 0, done.stderr
    assert f"drew predicted memory over the step to {png}" in done.stdout and "within budget" in done.stdout
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 20_000


@pytest.mark.slow
def test_sweep_measures_and_draws_the_budget(run_remat, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "pareto.png"
    done = run_remat("sweep", "mlp", "--batch", "2", "--points", "3", "--measure", "--budget", "60%",
                     "--plot", str(png))
    assert done.returncode == 0, done.stderr
    assert "measured peak" in done.stdout.splitlines()[0] and png.stat().st_size > 20_000

"""The remat command, end to end on small models."""
import json

import pytest

from remat.cli import main


@pytest.mark.slow
def test_plan_on_the_default_model(capsys, tmp_path):
    code, plan = tmp_path / "forward.py", tmp_path / "plan.json"
    assert main(["plan", "--budget", "40%", "--measure", "--code", str(code), "--save", str(plan)]) == 0
    out = capsys.readouterr().out
    assert "predicted peak" in out and "(fits)" in out and "within budget" in out
    assert "torch.utils.checkpoint.checkpoint(" in code.read_text()
    assert json.loads(plan.read_text())["solver"] == "rotor"


@pytest.mark.slow
def test_flops_and_profile(capsys):
    assert main(["flops", "mlp", "--batch", "2"]) == 0
    assert "aten.addmm" in capsys.readouterr().out
    assert main(["profile", "mlp", "--batch", "2", "--measure", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "predicted peak" in out and "measured peak" in out


@pytest.mark.slow
def test_sweep_draws_a_plot(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "pareto.png"
    assert main(["sweep", "mlp", "--batch", "2", "--points", "3", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "rotor" in out and "chen-greedy" in out and png.stat().st_size > 1000


@pytest.mark.slow
def test_errors_are_messages_not_tracebacks(capsys):
    assert main(["plan", "--budget", "1e-9"]) == 1
    assert "InfeasibleBudget" in capsys.readouterr().err
    assert main(["plan", "--budget", "lots"]) == 2
    assert "cannot parse" in capsys.readouterr().err
    assert main(["flops", "nope"]) == 2


@pytest.mark.slow
def test_plan_for_fsdp_shows_the_per_process_plan(capsys):
    assert main(["plan", "mlp", "--batch", "2", "--budget", "50%", "--world-size", "4", "--sharding", "fsdp"]) == 0
    out = capsys.readouterr().out
    assert "predicted peak" in out and "per process of 4" in out
    assert main(["plan", "mlp", "--batch", "2", "--world-size", "4", "--sharding", "fsdp", "--measure"]) == 2
    assert "process group" in capsys.readouterr().err
    assert main(["plan", "mlp", "--batch", "2", "--world-size", "4"]) == 2
    assert "sharding='fsdp'" in capsys.readouterr().err

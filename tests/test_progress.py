"""Progress lines, -q/-v, and a quiet --measure: what the user sees on stderr."""
import io
import logging
import os
import pty
import subprocess
import sys
import threading

import pytest

from conftest import remat_env
from remat import progress


def _finished(shown: str) -> list[str]:
    """The lines a terminal keeps: each step's final line (after the live line's last redraw)."""
    return [line.rstrip("\r").rsplit("\r\x1b[K", 1)[-1] for line in shown.split("\n") if line.strip()]


def test_steps_report_their_times_and_what_ran_inside():
    out = io.StringIO()
    progress.enable(out)
    try:
        with progress.step("plan", "rotor"):
            for _ in range(2):
                with progress.step("solve"):
                    pass
            with progress.step("verify"):
                pass
        with pytest.raises(KeyError):
            with progress.step("measure"):
                raise KeyError("boom")
    finally:
        progress.disable()
    lines = _finished(out.getvalue())
    assert len(lines) == 2, lines
    assert lines[0].startswith("remat: plan (rotor)  ") and "solve 0.0 s x2" in lines[0] and "verify 0.0 s" in lines[0]
    assert lines[1].startswith("remat: measure  failed after ")


def test_steps_are_silent_when_off_and_logged_at_debug(caplog):
    assert not progress.enabled()
    with caplog.at_level(logging.DEBUG, logger="remat"):
        with progress.step("profile"):
            pass
    messages = [r.getMessage() for r in caplog.records if r.name == "remat.progress"]
    assert messages[0] == "profile: start" and messages[1].startswith("profile: done in ")


def _run_on_a_terminal(*argv: str) -> tuple[int, str]:
    """Run remat with stderr on a pseudo-terminal (stdout a pipe); returns (code, what stderr showed)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "remat.cli", *argv], env=remat_env(), stdout=subprocess.PIPE,
                            stderr=slave, text=True)
    os.close(slave)
    chunks: list[bytes] = []

    def read() -> None:
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # the child closed the terminal
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read)
    reader.start()
    proc.communicate(timeout=300)
    reader.join(timeout=10)
    os.close(master)
    return proc.returncode, b"".join(chunks).decode(errors="replace")


@pytest.mark.slow
def test_the_cli_shows_progress_on_a_terminal_and_not_with_q():
    code, shown = _run_on_a_terminal("profile", "mlp", "--batch", "1", "--top", "1")
    assert code == 0, shown
    finished = _finished(shown)
    assert any(line.startswith("remat: trace and check  ") for line in finished), shown
    assert any(line.startswith("remat: profile  ") and line.endswith(" s") for line in finished), shown
    code, shown = _run_on_a_terminal("profile", "mlp", "--batch", "1", "--top", "1", "-q")
    assert code == 0 and "remat:" not in shown, shown


@pytest.mark.slow
def test_v_logs_the_steps_and_a_pipe_gets_no_progress(run_remat):
    done = run_remat("profile", "mlp", "--batch", "1", "--top", "1")
    assert done.returncode == 0 and done.stderr == "", done.stderr  # not a terminal: no progress
    done = run_remat("profile", "mlp", "--batch", "1", "--top", "1", "-v")
    assert done.returncode == 0, done.stderr
    assert "remat.progress: trace and check: start" in done.stderr
    assert "remat.progress: profile: done in" in done.stderr


@pytest.mark.slow
def test_measure_prints_no_profiler_log_lines(run_remat):
    """torch.profiler's backend logs `USDT: ...` and, without a GPU, `ERROR: ... gpuGetDeviceCount`
    when it starts; remat's measurements must not pass them on (instrument.py)."""
    for argv in (["profile", "mlp", "--batch", "1", "--top", "1", "--measure"],
                 ["plan", "mlp", "--batch", "1", "--budget", "1.0", "--measure"]):
        done = run_remat(*argv)
        assert done.returncode == 0, done.stderr
        assert "measured peak" in done.stdout
        bad = [line for line in done.stderr.splitlines() if "USDT" in line or line.startswith("ERROR:")
               or "ERROR:" in line]
        assert not bad, bad

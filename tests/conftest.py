import os
import tempfile

import pytest
import torch

# Kernel scratch measured by the tests lands in a fresh cache, not the user's (~/.cache/remat).
os.environ.setdefault("REMAT_CACHE_DIR", tempfile.mkdtemp(prefix="remat-test-cache-"))

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def remat_env(**extra: str) -> dict:
    """The environment for a ``remat`` subprocess: this checkout's (or the installed) remat first."""
    import remat

    src = os.path.dirname(os.path.dirname(os.path.abspath(remat.__file__)))
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "REMAT_CACHE_DIR": os.environ["REMAT_CACHE_DIR"], **extra}


@pytest.fixture
def run_remat():
    """Run the real ``remat`` command (``python -m remat.cli ARGS``) in a subprocess."""
    import subprocess
    import sys

    def run(*args: str, cwd=None, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "remat.cli", *args], cwd=cwd, env=remat_env(**env),
                              capture_output=True, text=True, timeout=timeout)

    return run

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

"""Where remat keeps what it measures on this machine (kernel scratch, op times, machine rates):
``$REMAT_CACHE_DIR``, else ``~/.cache/remat``.  Deleting the folder makes remat measure again."""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    return Path(os.environ.get("REMAT_CACHE_DIR") or Path.home() / ".cache" / "remat")

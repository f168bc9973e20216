"""Human units at the edges: bytes and FLOPs are ints inside remat, strings only for people."""
from __future__ import annotations

import math
import re

__all__ = ["parse_bytes", "fmt_bytes", "fmt_flops"]

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> int:
    """``"1.5GiB"`` -> 1610612736; ``"800MB"`` -> 800000000.  Raises ValueError on anything else."""
    m = _SIZE.match(text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot parse {text!r} as a size: use bytes or a unit such as '800MB' or '1.5GiB'")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not math.isfinite(value):
        raise ValueError(f"size {text!r} is not finite")
    return int(round(value))


def fmt_bytes(n: float) -> str:
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{sign}{n / scale:.2f} {unit}"
    return f"{sign}{int(n)} B"


def fmt_flops(n: float) -> str:
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3f}{unit}"
    return f"{int(n)}"

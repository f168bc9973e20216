"""Chen et al. 2016 ("Training deep nets with sublinear memory cost"): sqrt(n) and greedy plans.

Both checkpoint consecutive segments of the chain, one level deep: a segment's internals are
dropped in the forward and recomputed once in the backward, so the recomputation is at most one
extra forward.  The last segment is left unchecked: its activations are needed at once.
"""
from __future__ import annotations

import math

from ..chain import Chain
from .base import Region

__all__ = ["sqrtn_regions", "segments_to_regions"]


def segments_to_regions(bounds: list[int], n: int, *, skip_last: bool = True) -> tuple[Region, ...]:
    """Regions for segments that start at ``bounds`` (sorted stage indices) and cover [0, n)."""
    starts = sorted(set([0, *[b for b in bounds if 0 < b < n]]))
    stops = [*starts[1:], n]
    regions = [Region(a, b) for a, b in zip(starts, stops)]
    return tuple(regions[:-1] if skip_last and len(regions) > 1 else regions)


def sqrtn_regions(chain: Chain) -> tuple[Region, ...]:
    """ceil(sqrt(n)) stages per segment, every segment but the last checkpointed."""
    n = len(chain)
    if n < 2:
        return ()
    size = math.ceil(math.sqrt(n))
    return segments_to_regions(list(range(0, n, size)), n)

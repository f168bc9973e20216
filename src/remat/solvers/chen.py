"""Chen et al. 2016 ("Training deep nets with sublinear memory cost"): sqrt(n) and greedy plans.

Both checkpoint consecutive segments of the chain, one level deep: a segment's internals are
dropped in the forward and recomputed once in the backward, so the recomputation is at most one
extra forward.  The last segment is left unchecked: its activations are needed at once.
"""
from __future__ import annotations

import math

from .base import Region
from ..chain import ChainModel
from .model import evaluate

__all__ = ["sqrtn_regions", "segments_to_regions", "greedy_candidates", "greedy_regions"]


def segments_to_regions(bounds: list[int], n: int, *, skip_last: bool = True) -> tuple[Region, ...]:
    """Regions for segments that start at ``bounds`` (sorted stage indices) and cover [0, n)."""
    starts = sorted(set([0, *[b for b in bounds if 0 < b < n]]))
    stops = [*starts[1:], n]
    regions = [Region(a, b) for a, b in zip(starts, stops)]
    return tuple(regions[:-1] if skip_last and len(regions) > 1 else regions)


def sqrtn_regions(n: int) -> tuple[Region, ...]:
    """ceil(sqrt(n)) stages per segment, every segment but the last checkpointed."""
    if n < 2:
        return ()
    size = math.ceil(math.sqrt(n))
    return segments_to_regions(list(range(0, n, size)), n)


def greedy_segments(model: ChainModel, B: float) -> tuple[list[int], int, int]:
    """Chen's Alg. 3 on the chain: keep a boundary once the outputs since the last one exceed B.

    Returns the segment starts, x (bytes of the kept boundaries) and y (largest segment sum).
    """
    starts, temp, x, y = [0], 0, 0, 0
    for i in range(len(model)):
        temp += model.y[i]
        if temp > B and i + 1 < len(model):
            x += model.y[i]
            y = max(y, temp)
            starts.append(i + 1)
            temp = 0
    return starts, x, max(y, temp)


def greedy_candidates(model: ChainModel) -> list[tuple[Region, ...]]:
    """The plans Chen's greedy search considers (no checkpointing among them).

    B is searched as in the paper's appendix: B = 0, then B = sqrt(x*y) from that run, then six
    points on [B/2, 2B].
    """
    n = len(model)
    _, x, y = greedy_segments(model, 0)
    b0 = math.sqrt(x * y)
    grid = [b0 / 2 + i * (2 * b0 - b0 / 2) / 5 for i in range(6)]
    candidates: list[tuple[Region, ...]] = [()]
    for B in [0.0, b0, *grid]:
        starts, _, _ = greedy_segments(model, B)
        candidates.append(segments_to_regions(starts, n))
    return candidates


def greedy_regions(model: ChainModel, limit: int) -> tuple[Region, ...] | None:
    """The least-recompute Chen-greedy candidate whose modeled peak fits ``limit`` bytes, or None."""
    best: tuple[int, tuple[Region, ...]] | None = None
    for regions in greedy_candidates(model):
        cost = evaluate(model, regions)
        if cost.peak <= limit and (best is None or cost.recompute < best[0]):
            best = (cost.recompute, regions)
    return None if best is None else best[1]

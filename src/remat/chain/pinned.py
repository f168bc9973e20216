"""Values every repeated block reads and no node saves (a decoder's causal mask): counted once.

Each region over such a block holds the value as an input until its backward, the first region
longest, so the stage model counts it once, alive the whole step, instead of once per region
(``ChainModel.pinned``).  A Llama 7B shape at batch 8 was over-predicted by 4 GiB of 38 GiB, its
128 MiB mask counted by each of 32 layer regions.
"""
from __future__ import annotations

from torch import fx

from ..profiler.node import profile_of

__all__ = ["shared_unsaved", "pinned_readers"]


def _instances(node: fx.Node) -> list[tuple[str, str]]:
    """(path, type) of the modules a node's op runs in, outermost first (``nn_module_stack``)."""
    stack = node.meta.get("nn_module_stack") or {}
    return [(path, str(kind)) for path, kind in stack.values()
            if isinstance(path, str) and not path.startswith("_empty_nn_module")]


def _repeated(a: list[tuple[str, str]], b: list[tuple[str, str]]) -> bool:
    """Whether two ops run in two instances of the same module type, siblings where their module
    stacks part (two decoder layers' attention), not one module and a part of it."""
    for (pa, ka), (pb, kb) in zip(a, b):
        if pa != pb:
            return ka == kb
    return False


def shared_unsaved(nodes: list[fx.Node], last_saved: dict[int, int]) -> frozenset[int]:
    """Storages no node saves (``last_saved``: storage -> last node saving it) that two instances of
    one module type read."""
    readers: dict[int, list[list[tuple[str, str]]]] = {}
    for n in nodes:
        if n.op in ("placeholder", "get_attr", "output"):
            continue
        unsaved = [u for u in profile_of(n).in_uids if u >= 0 and u not in last_saved]
        where = _instances(n) if unsaved else None
        for u in unsaved if where else ():
            readers.setdefault(u, []).append(where)
    return frozenset(u for u, found in readers.items()
                     if any(_repeated(a, b) for i, a in enumerate(found) for b in found[i + 1:]))


def pinned_readers(nodes: list[fx.Node], stage_of: dict[int, int], pinned: frozenset[int],
                   stages: int) -> list[tuple[int, ...]]:
    """Per stage, the later stages reading the pinned values it made (``ChainModel.pinned_readers``);
    ``stage_of``: each node index's stage."""
    made: dict[int, int] = {}
    readers: dict[int, set[int]] = {}
    for j, n in enumerate(nodes):
        if j not in stage_of:
            continue
        prof = profile_of(n)
        for u in prof.out_uids & pinned:
            made.setdefault(u, stage_of[j])
        for u in prof.in_uids & pinned:
            if u in made and stage_of[j] > made[u]:
                readers.setdefault(made[u], set()).add(stage_of[j])
    return [tuple(sorted(readers.get(i, ()))) for i in range(stages)]

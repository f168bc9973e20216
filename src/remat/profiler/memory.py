"""Storage lifetimes on fake tensors: the simulated allocator behind every memory prediction.

A storage is allocated when an op first returns a tensor on it and freed when its last Python or
autograd reference dies (a weakref finalizer on the storage object, which PyTorch keeps unique per
storage).  Views and in-place results land on known storages and cost nothing, exactly as in a
real run.  Storages that exist before the step (parameters, buffers, inputs) are resident and are
never counted as allocations.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["StorageTracker", "storages_of", "storage_key", "storage_bytes"]


def storage_key(t: torch.Tensor) -> int:
    return id(t.untyped_storage())


def storage_bytes(tensors: Iterable[torch.Tensor], allocated: Callable[[int], int] | None = None) -> int:
    """Bytes of the distinct storages behind live ``tensors``, real or fake: views and tied weights
    count once (PyTorch keeps one storage object per storage), a DTensor counts its local shard
    (FSDP2's parameters), a meta tensor nothing.  ``allocated``: what the device's allocator holds
    for a storage of n bytes (CUDA: whole 512-byte blocks; a 4000-byte bias holds 4096)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        if hasattr(t, "to_local"):
            t = t.to_local()
        if t.device.type == "meta":
            continue
        st = t.untyped_storage()
        seen[id(st)] = st.nbytes() if allocated is None else allocated(st.nbytes())
    return sum(seen.values())


def tensors_in(x: Any) -> Iterator[torch.Tensor]:
    """The tensors of an op's arguments or outputs (tensors, nested in lists and tuples)."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from tensors_in(y)


def storages_of(out: Any) -> list[torch.UntypedStorage]:
    """The storages of every tensor in an op's output (tuple/list outputs included)."""
    if isinstance(out, torch.Tensor):
        return [out.untyped_storage()]
    if isinstance(out, (tuple, list)):
        found: list[torch.UntypedStorage] = []
        for o in out:
            if isinstance(o, torch.Tensor):
                found.append(o.untyped_storage())
            elif isinstance(o, (tuple, list)):
                found.extend(storages_of(o))
        return found
    return []


@dataclass
class StorageTracker:
    """Running total and peak of live storage bytes, in allocation order."""

    current: int = 0
    peak: int = 0
    owner: str | None = None  # who allocates now (a graph node's name), recorded per storage
    _live: dict[int, int] = field(default_factory=dict)  # id(storage) -> bytes
    _uid: dict[int, int] = field(default_factory=dict)  # id(storage) -> stable uid while alive
    _resident: dict[int, int] = field(default_factory=dict)  # id(storage) -> uid (negative)
    _window_peak: int = 0  # peak since the last mark(), for per-node temporaries
    _next_uid: int = 0
    producer: dict[int, str | None] = field(default_factory=dict)  # uid -> owner that allocated it
    nbytes: dict[int, int] = field(default_factory=dict)  # uid -> bytes, for every storage ever seen
    on_change: Callable[[int], None] | None = None  # called with ``current`` after every change (timelines)
    # what the device's allocator counts for an allocation of n bytes (CUDA: multiples of 512);
    # resident storages are counted as they are, as measure_peak counts them
    round_bytes: Callable[[int], int] | None = None

    def _rounded(self, nbytes: int) -> int:
        return self.round_bytes(nbytes) if self.round_bytes is not None else nbytes

    def mark_resident(self, tensors: Iterable[torch.Tensor]) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor) and storage_key(t) not in self._resident:
                st = t.untyped_storage()
                uid = -1 - len(self._resident)
                self._resident[id(st)] = uid
                self.nbytes[uid] = st.nbytes()

    def uid(self, t: torch.Tensor) -> int | None:
        """A stable id of ``t``'s storage: negative for resident storages, None if untracked."""
        key = storage_key(t)
        if key in self._resident:
            return self._resident[key]
        return self._uid.get(key)

    def live_bytes(self, t: torch.Tensor | int) -> int:
        """Bytes the allocator holds now for ``t``'s storage (or the storage of that key), a
        kernel's larger output included; 0 for resident, freed or untracked storages."""
        return self._live.get(t if isinstance(t, int) else storage_key(t), 0)

    def allocate(self, storages: Iterable[torch.UntypedStorage]) -> int:
        """Register new storages; returns the bytes newly allocated."""
        added = 0
        for st in storages:
            key = id(st)
            if key in self._live or key in self._resident:
                continue
            nbytes = self._rounded(st.nbytes())
            self._live[key] = nbytes
            self._uid[key] = uid = self._next_uid
            self._next_uid += 1
            self.producer[uid] = self.owner
            self.nbytes[uid] = nbytes
            weakref.finalize(st, self._free, key)
            added += nbytes
        if added:
            self._bump(added)
        return added

    def is_new(self, st: torch.UntypedStorage) -> bool:
        """Not yet tracked (neither resident nor allocated by an earlier op)."""
        return id(st) not in self._live and id(st) not in self._resident

    def grow(self, st: torch.UntypedStorage, nbytes: int) -> None:
        """``st`` really holds ``nbytes`` more than its fake twin (a kernel's larger output): counted
        now and freed with it."""
        key = id(st)
        if key in self._live and nbytes > 0:
            self._live[key] += nbytes
            self.nbytes[self._uid[key]] += nbytes
            self._bump(nbytes)

    def transient(self, nbytes: int) -> None:
        """Memory a kernel allocates and frees inside one op (workspaces): raises the peak only."""
        if nbytes > 0:
            nbytes = self._rounded(nbytes)
            self._bump(nbytes)
            self.current -= nbytes
            if self.on_change is not None:
                self.on_change(self.current)

    def hold(self, nbytes: int) -> None:
        """Bytes that stay allocated until the step ends (we cannot see when they are freed)."""
        if nbytes > 0:
            self._bump(self._rounded(nbytes))

    def _bump(self, nbytes: int) -> None:
        self.current += nbytes
        if self.current > self.peak:
            self.peak = self.current
        if self.current > self._window_peak:
            self._window_peak = self.current
        if self.on_change is not None:
            self.on_change(self.current)

    def _free(self, key: int) -> None:
        nbytes = self._live.pop(key, None)
        self._uid.pop(key, None)
        if nbytes is not None:
            self.current -= nbytes
            if self.on_change is not None:
                self.on_change(self.current)

    def mark(self) -> int:
        """Start a window for ``window_peak``; returns the current total."""
        self._window_peak = self.current
        return self.current

    @property
    def window_peak(self) -> int:
        return self._window_peak

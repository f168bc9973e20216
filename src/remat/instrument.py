"""The allocator instruments every measurement in remat reads.

* CPU: the allocator's own events, recorded by ``torch.profiler`` with ``profile_memory=True``:
  the running sum of every allocation and free from the start of the window (a free the profiler
  missed, on a thread it does not record, counted when its address is reused: ``cpu_window``).
* CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``.

torch.profiler's backend (kineto) writes log lines to the process's stderr when it starts and stops
(``USDT: ... profiler_start``, and on a machine without a GPU ``ERROR: ... gpuGetDeviceCount``);
they say nothing about the run, so stderr is silenced while the profiler starts and stops only,
and the user's logging settings are left as they are.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


__all__ = ["Window", "cpu_window", "quiet_stderr"]


@contextmanager
def quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2 (C++ logging included) for the duration of the block."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no real stderr (embedded interpreters): nothing to silence
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


@dataclass(frozen=True)
class Window:
    """What the allocator did during one window: its highest and its final total (bytes above the
    start), and the value the measured function returned."""

    peak: int
    end: int
    value: Any = None
    series: tuple[int, ...] = ()  # the running total after each allocator event (``series=True``)


def cpu_window(fn: Callable[[], Any], series: bool = False) -> Window:
    """Run ``fn`` under the CPU allocator's events; keeps ``fn``'s result alive to the window's end,
    so ``end`` counts what it returned.  ``series=True`` also keeps the running total after every
    event (a memory curve over the window).

    The profiler records allocator events only on the threads it profiles.  A buffer allocated here
    and freed on another thread (gloo's worker releasing a collective's input after FSDP dropped
    it: which thread frees it is a race) is counted as freed when its address is handed out again,
    never earlier, so the measured peak stays an upper bound of the true one.  A free of a block
    allocated before the window is not counted."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with quiet_stderr():
        prof.__enter__()
    try:
        value = fn()
    finally:
        with quiet_stderr():
            prof.__exit__(None, None, None)
    running = peak = 0
    curve: list[int] = []
    live: dict[int, int] = {}  # address -> bytes of each allocation seen and not yet seen freed
    for ptr, nbytes in _allocator_events(prof):
        if nbytes > 0:
            # An address handed out again was freed where the profiler does not look: on a thread it
            # does not record (a collective backend's worker drops the last reference to a buffer
            # the step allocated).  Count that free now, the latest it can have happened.
            running -= live.pop(ptr, 0)
            live[ptr] = nbytes
            running += nbytes
        else:
            # Only what the window saw allocated is taken off: a block from before it (garbage the
            # GC collects mid-step; torch warns "allocated before the profiling started") is not
            # the step's, and its free must not offset the step's allocations.
            running -= live.pop(ptr, 0)
        peak = max(peak, running)
        if series:
            curve.append(running)
    return Window(peak, running, value, tuple(curve))


def _allocator_events(prof: Any) -> list[tuple[int, int]]:
    """(address, bytes) of every CPU allocator event of a finished profile in time order (bytes < 0
    for a free).  Only threads the profiler records report; see ``cpu_window``."""
    from torch._C._profiler import _ExtraFields_Allocation

    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        fields = event.extra_fields
        if isinstance(fields, _ExtraFields_Allocation) and fields.device.type == "cpu" and fields.alloc_size:
            events.append((event.start_time_ns, event.id, fields.ptr, fields.alloc_size))
    events.sort()
    return [(ptr, nbytes) for _, _, ptr, nbytes in events]

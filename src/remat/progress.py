"""Progress of the pipeline's steps (trace, profile, solve, verify, measure), with elapsed times.

``with progress.step("profile"): ...`` marks one step.  Every step logs its start and end at DEBUG
on the ``remat.progress`` logger.  When progress is on (``enable()``; the CLI turns it on when
stderr is a terminal), a line on stderr shows the running step and its elapsed time, updated by a
background thread, and each finished top-level step leaves one line with its time and the times
of the steps inside it (``plan  12.3 s  (solve 4.1 s x3, verify 8.0 s x3)``).  Off, a step costs
two ``perf_counter`` calls and two disabled log calls.
"""
from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TextIO

__all__ = ["step", "enable", "disable", "enabled"]

log = logging.getLogger(__name__)

_SPIN = "|/-\\"
_TICK = 0.1  # seconds between redraws of the live line


@dataclass
class _Step:
    name: str
    detail: str
    start: float = field(default_factory=time.perf_counter)
    inner: dict[str, list[float]] = field(default_factory=dict)  # name -> [total seconds, count]


@dataclass
class _State:
    stream: TextIO | None = None  # None: off
    stack: list[_Step] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    ticker: threading.Thread | None = None
    frame: int = 0


_state = _State()


def enable(stream: TextIO | None = None) -> None:
    """Show progress on ``stream`` (default: stderr) from now on."""
    _state.stream = stream or sys.stderr


def disable() -> None:
    _state.stream = None


def enabled() -> bool:
    return _state.stream is not None


def _label(s: _Step) -> str:
    return f"{s.name} ({s.detail})" if s.detail else s.name


def _draw(final: str | None = None) -> None:
    """Redraw the live line (or replace it by ``final`` and a newline); call with the lock held."""
    out = _state.stream
    if out is None:
        return
    if final is not None:
        out.write(f"\r\x1b[K{final}\n")
    elif _state.stack:
        now = time.perf_counter()
        path = " > ".join(_label(s) for s in _state.stack)
        _state.frame += 1
        out.write(f"\r\x1b[Kremat {_SPIN[_state.frame % len(_SPIN)]} {path}  {now - _state.stack[0].start:.1f} s")
    out.flush()


def _tick() -> None:
    while True:
        time.sleep(_TICK)
        with _state.lock:
            if not _state.stack:
                _state.ticker = None
                return
            _draw()


def _summary(s: _Step, seconds: float, failed: bool) -> str:
    inner = ", ".join(f"{name} {total:.1f} s" + (f" x{count:g}" if count > 1 else "")
                      for name, (total, count) in s.inner.items())
    verdict = "failed after " if failed else ""
    return f"remat: {_label(s)}  {verdict}{seconds:.1f} s" + (f"  ({inner})" if inner else "")


@contextmanager
def step(name: str, detail: str = "") -> Iterator[None]:
    """One step of the pipeline: logged at DEBUG, and shown while it runs when progress is on."""
    current = _Step(name, detail)
    log.debug("%s: start%s", name, f" ({detail})" if detail else "")
    with _state.lock:
        _state.stack.append(current)
        if _state.stream is not None and _state.ticker is None:
            _state.ticker = threading.Thread(target=_tick, name="remat-progress", daemon=True)
            _state.ticker.start()
    failed = True
    try:
        yield
        failed = False
    finally:
        seconds = time.perf_counter() - current.start
        log.debug("%s: %s in %.2f s", name, "failed" if failed else "done", seconds)
        with _state.lock:
            if current in _state.stack:
                _state.stack.remove(current)
            if _state.stack:
                totals = _state.stack[-1].inner.setdefault(name, [0.0, 0])
                totals[0] += seconds
                totals[1] += 1
            else:
                _draw(_summary(current, seconds, failed))

"""Real peak memory of one training step, as docs/design.md defines it (and the memory curve behind it).

Peak = bytes resident before the step (parameters, buffers, inputs) + the highest amount allocated
during the step above that.  On the CPU the amount comes from the allocator's own events
(``torch.profiler`` with ``profile_memory=True``: the running sum of every ``[memory]`` record); on
CUDA from ``torch.cuda.max_memory_allocated()`` after ``reset_peak_memory_stats()``, minus what was
allocated when the step began (the cuBLAS workspaces torch caches are freed first and counted as the
step allocates them again).

A real step writes ``.grad`` and updates BatchNorm statistics; ``measure_peak`` puts both back, so
the caller's model leaves it as it came in.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from .instrument import Window, cpu_window
from .profiler.memory import storage_bytes
from .profiler.rules import round_up
from .step import loss_of

__all__ = ["measure_peak", "measure_series", "resident_bytes"]


def resident_bytes(model: torch.nn.Module, args: Any, kwargs: Any = None) -> int:
    """Bytes the allocator holds for the parameters, buffers and inputs (on CUDA whole 512-byte
    blocks, as ``max_memory_allocated`` counts the step's own allocations)."""
    flat, _ = tree_flatten((args, kwargs or {}))
    tensors = [t for t in [*model.parameters(), *model.buffers(), *flat] if isinstance(t, torch.Tensor)]
    on_cuda = any(t.device.type == "cuda" for t in tensors)
    return storage_bytes(tensors, (lambda n: round_up(n, "cuda")) if on_cuda else None)


@contextmanager
def _restored(model: torch.nn.Module, inputs: list[torch.Tensor]) -> Iterator[None]:
    """Run a real step and put back every .grad (the inputs' too) and buffer as it was."""
    grads = {p: p.grad for p in [*model.parameters(), *(t for t in inputs if t.requires_grad)]}
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    for p in grads:
        p.grad = None
    try:
        yield
    finally:
        for p, g in grads.items():
            p.grad = g
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])


def _step(model: torch.nn.Module, args: tuple, kwargs: dict, inputs: list[torch.Tensor]) -> None:
    loss = loss_of(model(*args, **kwargs))
    if loss is not None:
        loss.backward()
    del loss
    for p in [*model.parameters(), *inputs]:
        p.grad = None  # the measured step starts with every .grad None, the inputs' too


def _cpu_window(model: torch.nn.Module, args: tuple, kwargs: dict, series: bool = False) -> Window:
    def step() -> None:
        loss = loss_of(model(*args, **kwargs))
        if loss is not None:
            loss.backward()

    return cpu_window(step, series)


def _cuda_peak_above(model: torch.nn.Module, args: tuple, kwargs: dict, device: torch.device) -> int:
    """max_memory_allocated above the start of one step.  torch keeps the cuBLAS workspaces its
    first matmul allocated (profiler/rules/cuda.py): they are freed first, so this step allocates
    them again and counts them, as remat's prediction does (resident bytes of every step)."""
    torch.cuda.synchronize(device)
    if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
        torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    loss = loss_of(model(*args, **kwargs))
    if loss is not None:
        loss.backward()
    del loss
    torch.cuda.synchronize(device)
    return max(0, torch.cuda.max_memory_allocated(device) - before)


def _measure(model: torch.nn.Module, example_inputs: Any, kwargs: dict | None, warmup: int,
             series: bool) -> Any:
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    kwargs = kwargs or {}
    flat, _ = tree_flatten((args, kwargs))
    tensors = [t for t in [*model.parameters(), *model.buffers(), *flat] if isinstance(t, torch.Tensor)]
    if any(t.device.type == "meta" for t in tensors):
        raise ValueError("measure_peak runs a real step: the model and inputs must not be on the meta device")
    device = next((t.device for t in tensors if t.device.type == "cuda"), torch.device("cpu"))
    if series and device.type != "cpu":
        raise ValueError("measure_series reads the CPU allocator's events: the model and inputs must be on the CPU")
    inputs = [t for t in flat if isinstance(t, torch.Tensor)]
    with _restored(model, inputs):
        for _ in range(warmup):
            _step(model, args, kwargs, inputs)
        resident = resident_bytes(model, args, kwargs)
        if series:
            return [resident + b for b in (0, *_cpu_window(model, args, kwargs, series=True).series)]
        if device.type == "cuda":
            above = _cuda_peak_above(model, args, kwargs, device)
        else:
            above = _cpu_window(model, args, kwargs).peak
    return resident + above


def measure_peak(model: torch.nn.Module, example_inputs: Any, kwargs: dict | None = None, *,
                 warmup: int = 1) -> int:
    """Measured peak bytes of one real training step of ``model`` (docs/design.md's definition).

    ``warmup`` unmeasured steps run first so lazily built kernels and caches are not counted.
    """
    return _measure(model, example_inputs, kwargs, warmup, series=False)


def measure_series(model: torch.nn.Module, example_inputs: Any, kwargs: dict | None = None, *,
                   warmup: int = 1) -> list[int]:
    """The bytes allocated (resident included) after every CPU allocator event of one real training
    step: the measured memory curve, whose maximum is ``measure_peak``'s value.  CPU only."""
    return _measure(model, example_inputs, kwargs, warmup, series=True)

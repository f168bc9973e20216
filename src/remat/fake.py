"""Fake views of a user's model and inputs: same shapes, dtypes and aliasing, no data, no copies.

Every profiling pass runs on these.  Parameters and buffers become fake tensors through
``FakeTensorMode.from_tensor`` (a metadata copy; the data is never read), and the module runs with
them through ``torch.func.functional_call``, so the user's module and tensors are left untouched.
Meta tensors (a model moved to meta, ``torch.rand(..., device="meta")`` inputs) become fake tensors
on the device the step would really run on, so dispatch picks the same kernels as a real run (on
the CPU, ``scaled_dot_product_attention`` is the flash kernel, on meta it would be the math path).
A session for another device (planning a GPU step from tensors on the CPU) makes every tensor on a
device other than its own a fake of the same size, strides, dtype and ``requires_grad`` on its
device; tensors sharing a storage share one fake storage.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["FakeSession", "target_device", "module_of"]


def module_of(fn: Callable[..., Any]) -> torch.nn.Module | None:
    """The module whose state ``fn`` uses: ``fn`` itself, or the owner of a bound method."""
    if isinstance(fn, torch.nn.Module):
        return fn
    owner = getattr(fn, "__self__", None)
    return owner if isinstance(owner, torch.nn.Module) else None


def target_device(tensors: Iterable[torch.Tensor]) -> torch.device:
    """The device a real step would use: the first non-meta device seen, else the CPU."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            return t.device
    return torch.device("cpu")


@dataclass
class FakeSession:
    """One FakeTensorMode plus the conversions into it, memoized so aliasing is preserved."""

    device: torch.device
    mode: FakeTensorMode = field(default_factory=lambda: FakeTensorMode(allow_non_fake_inputs=True))
    # id(real) -> (real, fake): holding the real tensor keeps its id from being reused.
    _memo: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # id(real storage) -> (real storage, fake storage), for tensors moved to another device
    _storages: dict[int, tuple[Any, Any]] = field(default_factory=dict)

    @classmethod
    def for_call(cls, module: torch.nn.Module | None, args: Any, kwargs: Any = None,
                 device: torch.device | None = None) -> "FakeSession":
        """A session for one call; ``device``: where its fakes live (default: where the call's
        tensors are)."""
        if device is not None:
            return cls(device)
        state = [] if module is None else [*module.parameters(), *module.buffers()]
        flat, _ = tree_flatten((args, kwargs or {}))
        return cls(target_device([*state, *flat]))

    def _moved(self, t: torch.Tensor) -> torch.Tensor:
        """A fake of ``t`` on this session's device over a fake twin of ``t``'s storage (so views of
        one storage stay views of one storage); ``t``'s data is never read."""
        real = t.untyped_storage()
        known = self._storages.get(id(real))
        with self.mode, torch.no_grad():
            if known is None:
                base = torch.empty(real.nbytes(), dtype=torch.uint8, device=self.device).untyped_storage()
                known = self._storages[id(real)] = (real, base)
            fake = torch.empty(0, dtype=t.dtype, device=self.device).set_(known[1], t.storage_offset(), t.size(),
                                                                          t.stride())
        return fake.requires_grad_(t.requires_grad)

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        """A fake twin of ``t`` with the same size, strides, dtype and requires_grad; no data."""
        if isinstance(t, torch._subclasses.FakeTensor):
            return t
        memo = self._memo.get(id(t))
        if memo is not None:
            return memo[1]
        if t.device.type not in ("meta", self.device.type):
            fake = self._moved(t)
        elif t.device.type == "meta":
            with self.mode:
                fake = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=self.device)
            fake.requires_grad_(t.requires_grad)
        elif t.numel() == 1 and not t.requires_grad and t.device.type == "cpu":
            # a scalar (BatchNorm's batch counter): keep its value, for code that reads it
            # (``momentum=None`` divides by ``float(num_batches_tracked)``)
            with unset_fake_temporarily():  # (the clone must be real even when called inside the mode)
                value = t.clone()
            fake = self.mode.fake_tensor_converter.from_real_tensor(self.mode, value, make_constant=True)
        else:
            fake = self.mode.from_tensor(t, static_shapes=True)
        if fake.grad is not None:
            fake.grad = None  # a step starts with every .grad None (docs/design.md's training step)
        self._memo[id(t)] = (t, fake)
        return fake

    def tree(self, tree: Any) -> Any:
        return tree_map(lambda x: self.tensor(x) if isinstance(x, torch.Tensor) else x, tree)

    def state(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Fake parameters and buffers by fully qualified name (tied names map to one fake)."""
        named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
        return {name: self.tensor(t) for name, t in named}

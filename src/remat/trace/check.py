"""The trace check: the traced module must train like the model before anything is planned on it.

Both run one training step (docs/design.md) on the same inputs with the same random seed: real inputs
cut to a batch of at most ``CHECK_BATCH`` (every tensor input whose first dimension is the batch),
or fake ones when the model or its inputs are on meta (then only shapes, dtypes and which
parameters get gradients can be compared).  Gradients come from ``torch.autograd.grad`` and the
buffers are copies, so the model's own ``.grad`` and statistics are left alone.  Compared, in the
order a user would notice them: the outputs, which parameters receive gradients, the gradient
values, the buffers after the step.

The model's own ``torch.utils.checkpoint`` calls run inline in the reference step: they do not
change what is computed, except that recomputation updates BatchNorm statistics a second time,
which remat's modules never do (``runtime.context``).
"""
from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from ..errors import RematError, RematWarning
from ..fake import FakeSession
from ..step import floating_outputs, loss_of, reparametrized
from .capture import capturing_checkpoints

__all__ = ["Mismatch", "check_trace", "CHECK_BATCH"]

# The check runs real steps of both modules; two samples keep it cheap at any batch and still
# exercise batch statistics (BatchNorm needs more than one value per channel).
CHECK_BATCH = 2


@dataclass(frozen=True)
class Mismatch:
    """The first difference a user would notice between the model and its trace."""

    what: str  # "output 0", "parameter 'frozen.weight'", "buffer 'bn.running_mean'"
    detail: str

    def __str__(self) -> str:
        return f"{self.what}: {self.detail}"


@dataclass
class _Step:
    outputs: list[torch.Tensor]
    grads: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor]


def _batch(args: tuple, kwargs: dict) -> int | None:
    sizes = [t.shape[0] for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.dim()]
    return Counter(sizes).most_common(1)[0][0] if sizes else None


def _cut(tree: Any, batch: int, keep: int) -> Any:
    return tree_map(lambda t: t[:keep] if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == batch else t,
                    tree)


_HALF = (torch.float16, torch.bfloat16)


def _half_autocast() -> bool:
    """Whether an autocast to a half dtype is on around the check (accelerate's or the Trainer's
    bf16): float32 tensors then compute in bf16, and two traces of the same ops round differently
    (a PEFT LoRA adapter's gradient differed by 0.05-0.5 at fp32's tolerance, PEFT + Trainer bf16)."""
    return any(torch.is_autocast_enabled(d) and torch.get_autocast_dtype(d) in _HALF for d in ("cpu", "cuda"))


def _tolerance(t: torch.Tensor, half: bool = False) -> tuple[float, float]:
    """(rtol, atol) for comparing two runs of the same ops: float32 sums may be reordered.
    ``half``: the step computes in half precision somewhere (a bf16 base model with float32
    LoRA adapters): a float32 gradient that flowed through bf16 activations has their roundoff."""
    # the largest finite magnitude; nan_to_num instead of a boolean mask, which costs ~20x more
    # (it gathers a copy) and ran for every output, gradient and buffer of every plan
    scale = float(t.detach().abs().nan_to_num_(0.0, 0.0, 0.0).max()) if t.numel() else 0.0
    if t.dtype in _HALF or half:
        return 2e-2, 2e-2 * max(scale, 1e-3)
    return 1e-4, 1e-5 * max(scale, 1e-3)


def _run(module: torch.nn.Module, args: tuple, kwargs: dict, names: dict[int, str], seed: int,
         fake: FakeSession | None) -> _Step:
    """One step of ``module`` on copies of its buffers; parameters and buffers are reported under
    the model's names (``names``: id of the model's tensor -> its name)."""
    params = {names.get(id(p), n): p for n, p in module.named_parameters()}
    buffers = {names.get(id(b), n): b for n, b in module.named_buffers()}
    by_own_name = {n: names.get(id(t), n) for n, t in [*module.named_parameters(), *module.named_buffers()]}
    state = {n: b.clone() for n, b in buffers.items()} if fake is None else {}
    with ExitStack() as stack:
        if fake is not None:
            stack.enter_context(fake.mode)
            state = {n: fake.tensor(t) for n, t in buffers.items()}
            params = {n: fake.tensor(p) for n, p in params.items()}
            args, kwargs = fake.tree(args), fake.tree(kwargs)
        stack.enter_context(torch.random.fork_rng(devices=[]))
        stack.enter_context(reparametrized(module, {own: {**params, **state}[model_name]
                                                    for own, model_name in by_own_name.items()}))
        torch.manual_seed(seed)
        out = module(*args, **kwargs)
        loss = loss_of(out)
        trainable = {n: p for n, p in params.items() if p.requires_grad}
        grads = dict.fromkeys(params)
        if loss is not None and trainable:
            found = torch.autograd.grad(loss, list(trainable.values()), allow_unused=True)
            grads.update(zip(trainable, found))
        outputs = [t.detach() for t in floating_outputs(out)]
    return _Step(outputs, grads, {n: b.detach() for n, b in state.items()})


def _compare(a: torch.Tensor, b: torch.Tensor, values: bool, half: bool = False) -> str | None:
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{tuple(b.shape)} {b.dtype} where the model gives {tuple(a.shape)} {a.dtype}"
    if not values or torch.equal(a, b):  # equal: the common case, and ~10x cheaper than allclose
        return None
    rtol, atol = _tolerance(a, half)
    if not torch.allclose(b.float(), a.float(), rtol=rtol, atol=atol, equal_nan=True):
        diff = (b.float() - a.float()).abs()
        finite = diff[torch.isfinite(diff)]
        largest = float(finite.max()) if finite.numel() else float("nan")
        return f"differs from the model's by up to {largest:.3g} (where both are finite)"
    return None


def _pairs(ref: _Step, got: _Step) -> Iterator[tuple[str, str, torch.Tensor | None, torch.Tensor | None]]:
    """(label, prefix of its message, the model's tensor, the other step's) for every output,
    parameter gradient and buffer, in the order they are reported."""
    for i, (a, b) in enumerate(zip(ref.outputs, got.outputs)):
        yield f"output {i}", "", a, b
    for name, a in ref.grads.items():
        yield f"parameter {name!r}", "gradient ", a, got.grads.get(name)
    for name, a in ref.buffers.items():
        yield f"buffer {name!r}", "after the step ", a, got.buffers.get(name)


def _differences(ref: _Step, got: _Step, values: bool, by_shape: frozenset[str] = frozenset(),
                 half: bool = False) -> Mismatch | None:
    """The first difference; the tensors named in ``by_shape`` are compared by shape and dtype only."""
    if len(ref.outputs) != len(got.outputs):
        return Mismatch("outputs", f"{len(got.outputs)} floating-point outputs where the model gives {len(ref.outputs)}")
    for what, prefix, a, b in _pairs(ref, got):
        if what.startswith("parameter") and (a is None) != (b is None):
            return Mismatch(what, "gets a gradient where the model gives none" if a is None
                            else "gets no gradient where the model gives one")
        if b is None and a is not None:
            return Mismatch(what, prefix + "is missing")
        why = None if a is None else _compare(a, b, values and what not in by_shape, half)
        if why:
            return Mismatch(what, prefix + why)
    return None


def _unreproducible(ref: _Step, again: _Step, half: bool = False) -> frozenset[str]:
    """The tensors two steps of the model itself do not reproduce (within the check's tolerance)."""
    return frozenset(what for what, _, a, b in _pairs(ref, again)
                     if a is not None and b is not None and _compare(a, b, True, half))


def check_trace(model: torch.nn.Module, traced: torch.nn.Module, args: tuple, kwargs: dict) -> Mismatch | None:
    """The first difference between one step of ``model`` and one of ``traced``, or None."""
    names = {id(t): n for n, t in [*model.named_parameters(remove_duplicate=False),
                                   *model.named_buffers(remove_duplicate=False)]}
    tensors = [t for t in (*model.parameters(), *model.buffers(), *tree_flatten((args, kwargs))[0])
               if isinstance(t, torch.Tensor)]
    fake = FakeSession.for_call(model, args, kwargs) if any(t.device.type == "meta" for t in tensors) else None
    half = any(t.dtype in _HALF for t in tensors) or _half_autocast()
    batch = _batch(args, kwargs)
    tries = [(args, kwargs)]
    if fake is None and batch is not None and batch > CHECK_BATCH:
        tries.insert(0, (_cut(args, batch, CHECK_BATCH), _cut(kwargs, batch, CHECK_BATCH)))
    for i, (a, k) in enumerate(tries):
        try:
            with capturing_checkpoints({}):  # the model's own checkpoint calls run inline (see above)
                ref = _run(model, a, k, names, 0, fake)
        except Exception:  # noqa: BLE001 - the model itself rejects the smaller batch: use the planned one
            if i + 1 < len(tries):
                continue
            raise
        sparse = sorted(n for n, g in ref.grads.items() if g is not None and g.layout != torch.strided)
        if sparse:
            raise RematError(f"parameter {sparse[0]!r} gets a sparse gradient (nn.Embedding or nn.EmbeddingBag "
                             "with sparse=True): remat profiles dense training steps only; with sparse=False "
                             "the step computes the same values with dense gradients")
        try:
            got = _run(traced, a, k, names, 0, fake)
        except Exception as e:  # noqa: BLE001
            if i + 1 < len(tries):  # a trace that pinned the batch (torch.export guards): check at the planned one
                continue
            return Mismatch("the traced module", f"fails where the model runs: {type(e).__name__}: {e}")
        found = _differences(ref, got, values=fake is None, half=half)
        if found is None or fake is not None:
            return found
        # A kernel that reduces in a thread-dependent order makes the model's own steps differ (bf16
        # depthwise convolution weight gradients: by up to half their scale at 2 threads): a second
        # step of the model tells those gradients apart, and they are compared by shape only.  Only
        # parameter gradients, and only when the outputs reproduce: outputs that differ between two
        # steps are a model drawing random numbers outside torch, which a trace bakes in.
        unstable = _unreproducible(ref, _run(model, a, k, names, 0, fake), half)
        if found.what not in unstable or any(not u.startswith("parameter ") for u in unstable):
            return found
        found = _differences(ref, got, values=True, by_shape=unstable, half=half)
        if found is None:
            warnings.warn(f"remat: two training steps of the model itself give different values for "
                          f"{', '.join(sorted(unstable))} (a kernel whose result depends on thread timing); "
                          "the trace check compared those by shape and dtype only", RematWarning, stacklevel=2)
        return found
    return None

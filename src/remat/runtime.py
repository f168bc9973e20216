"""What generated modules call at run time; the generated code imports it as ``remat.runtime``.

Keep these names stable: a module written out with ``remat plan --code`` or pickled refers to them.

* ``context``: checkpoint keyword arguments for what a region needs: keeping the outputs of its
  expensive ops (selective checkpointing), and not updating module state (BatchNorm running
  statistics) a second time when it is recomputed.
* ``check_inputs``: the shape contract of a plan (contract.py; re-exported here, where generated
  code calls it).
* ``RematModule``: the GraphModule class of generated modules; it pickles as its code and state
  (fx would re-trace the code, inlining the checkpoint calls) and ``restore`` reads it back.
"""
from __future__ import annotations

import contextlib
import functools
from enum import Enum
from typing import Any

import torch
from torch import fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy

from .contract import InputContract, autocast_state, check_inputs
from .errors import KeptOutputOverwritten
from .profiler.registry import lookup
from .profiler.rules import written_arguments

__all__ = ["Freeze", "Save", "context", "freeze_state", "check_inputs", "InputContract", "RematModule", "restore", "attach_forward"]


class _FrozenStateMode(TorchDispatchMode):
    """During recomputation: state-writing ops run on copies, in-place updates of state are skipped."""

    def __init__(self, state: set[int]) -> None:
        super().__init__()
        self.state = state  # ids of the buffers' storage objects (unique per storage, fake ones too)

    def _is_state(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and id(t.untyped_storage()) in self.state

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        written = {key for _, key, value in written_arguments(func, args, kwargs) if self._is_state(value)}
        if not written:
            return func(*args, **kwargs)
        if written == {0}:
            return args[0]  # e.g. num_batches_tracked.add_(1): already applied in the first forward
        # e.g. BatchNorm's running statistics: let it write into copies
        return func(*(a.clone() if i in written else a for i, a in enumerate(args)),
                    **{k: v.clone() if k in written else v for k, v in kwargs.items()})


class _FrozenBatchNorms:
    """During recomputation: BatchNorm modules run with momentum 0 (their statistics keep their
    values: 1 * old + 0 * new) and their batch counters are put back.  No per-op Python dispatch,
    so recomputation runs at full speed."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.norms = [m for m in module.modules()
                      if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats]

    def __enter__(self) -> None:
        self.saved = [(m, m.momentum, None if m.num_batches_tracked is None else m.num_batches_tracked.clone())
                      for m in self.norms]
        for m in self.norms:
            m.momentum = 0.0

    def __exit__(self, *exc: object) -> None:
        with torch.no_grad():
            for m, momentum, count in self.saved:
                m.momentum = momentum
                if count is not None:
                    m.num_batches_tracked.copy_(count)


class _RestoredState:
    """State a region writes and reads back (spectral norm's power iteration: it updates ``_u`` and
    ``_v`` in place, then computes the weight from them).  Recomputing such a region must start
    from the state its forward started from, and leave the state as the step left it: the forward
    keeps a copy of it; the recomputation swaps that copy in and puts the current values back after."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.before: list[torch.Tensor] = []

    @contextlib.contextmanager
    def forward(self) -> Any:
        with torch.no_grad():
            self.before = [t.clone() for t in self.tensors]
        yield

    @contextlib.contextmanager
    def recompute(self) -> Any:
        with torch.no_grad():
            now = [t.clone() for t in self.tensors]
            for t, b in zip(self.tensors, self.before):
                t.copy_(b)
        try:
            yield
        finally:
            with torch.no_grad():
                for t, n in zip(self.tensors, now):
                    t.copy_(n)


def _state_tensor(module: torch.nn.Module, name: str) -> torch.Tensor:
    try:
        return module.get_buffer(name)
    except AttributeError:
        return module.get_parameter(name)


def _save_compute(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """Selective checkpointing policy: keep the outputs of the ops remat's FLOP registry counts as
    multiply-adds (matmul, convolution, attention), recompute everything else."""
    formula = lookup(op).formula
    return CheckpointPolicy.MUST_SAVE if formula is not None and formula.mac else CheckpointPolicy.PREFER_RECOMPUTE


_MUTATED = "Tensor cached during selective activation checkpoint has been mutated"


def _overwritten(region: str, writer: str, kept: str) -> KeptOutputOverwritten:
    return KeptOutputOverwritten(
        f"checkpoint region {region or '(unnamed)'} keeps the output of {kept} for its recomputation "
        f"(save=\"compute\"), but {writer} writes into it in place afterwards: the recomputation would "
        "read the overwritten values and compute wrong gradients. remat's planner never offers such a "
        "region; for a hand-made plan, drop the region's save-compute policy")


class _KeepGuard:
    """The keep policy of one region's forward, guarded.

    torch's selective checkpoint hands the kept tensors back to the recomputation as they are then.
    A write after the save makes that wrong, and torch checks only the kept tensor's version
    counter, which misses writes through ``unsafe_split`` chunks (GRUCell's in-place gates on its
    addmm outputs on the CPU).  The policy sees every op of the region's forward: a write into
    the storage of a kept output raises at once, naming both ops.  Writes after the region are
    refused at plan time (``NodeProfile.keep_refused``); torch's version check, translated by
    ``_Translated``, catches the rest on the recomputation."""

    def __init__(self, region: str) -> None:
        self.region = region
        # the kept outputs' storages (their StorageImpl addresses: torch holds each kept tensor until
        # the backward, so no other live storage has one; a Python storage object's id() can be
        # reused once it is collected, which is why not that) -> the op whose output it is
        self.kept: dict[int, str] = {}

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        if self.kept:
            for _, _, value in written_arguments(op, args, kwargs):
                if isinstance(value, torch.Tensor) and value.untyped_storage()._cdata in self.kept:
                    raise _overwritten(self.region, str(op), self.kept[value.untyped_storage()._cdata])
        policy = _save_compute(ctx, op, *args, **kwargs)
        if policy == CheckpointPolicy.MUST_SAVE:
            for t in tree_leaves(ctx.op_output):
                if isinstance(t, torch.Tensor):
                    self.kept[t.untyped_storage()._cdata] = str(op)
        return policy


class _Translated:
    """The recomputation context of a keeping region: torch's "cached tensor has been mutated"
    becomes a RematError naming the region."""

    def __init__(self, inner: Any, region: str) -> None:
        self.inner, self.region = inner, region

    def __enter__(self) -> None:
        self.inner.__enter__()

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> Any:
        handled = self.inner.__exit__(kind, exc, tb)
        if isinstance(exc, RuntimeError) and _MUTATED in str(exc):
            raise _overwritten(self.region, "an op after the region", "an op it keeps") from exc
        return handled


class Freeze(str, Enum):
    """How a region that writes module state is recomputed (the strings generated code passes).

    - ``NONE``: it writes none.
    - ``MODULES``: BatchNorm modules (symbolic traces) recompute with momentum 0 and their batch
      counters put back: their statistics are not updated twice, at no cost (``_FrozenBatchNorms``).
    - ``OPS``: state written by aten ops (torch.export graphs) is written into copies during the
      recomputation (``_FrozenStateMode``).
    - ``STATE``: state the region writes and reads back (spectral norm's vectors) is recomputed from
      a copy taken in the forward and put back after (``_RestoredState``).
    """

    NONE = ""
    MODULES = "modules"
    OPS = "ops"
    STATE = "state"


class Save(str, Enum):
    """What a region keeps for its recomputation: ``NONE`` (torch's checkpoint: nothing) or
    ``COMPUTE`` (the outputs of its matmul/conv/attention ops, guarded: ``_KeepGuard``)."""

    NONE = ""
    COMPUTE = "compute"


class _Both:
    """Two context managers entered as one."""

    def __init__(self, first: Any, second: Any) -> None:
        self.stack = contextlib.ExitStack()
        self.first, self.second = first, second

    def __enter__(self) -> None:
        self.stack.enter_context(self.first)
        self.stack.enter_context(self.second)

    def __exit__(self, *exc: object) -> Any:
        return self.stack.__exit__(*exc)


class _AutocastCacheOff:
    """Autocast's cast cache off from here to the end of a keeping region's forward.

    Under autocast a parameter is cast once per outermost autocast block and the cast reused, so a
    region's forward dispatches no cast for a parameter cast earlier (by an earlier region, a tied
    weight, or a step run before in the same block), while its recomputation, in a fresh block,
    does; torch's selective checkpoint replays the forward's op sequence and fails on the extra
    ``aten._to_copy``.  Without the cache both dispatch the same casts.  Created inside
    ``context_fn``, which torch calls before it records the autocast state (``cache_enabled``
    included) that the recomputation re-enters."""

    def __init__(self) -> None:
        self.before = torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(False)

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc: object) -> None:
        torch.set_autocast_cache_enabled(self.before)


def context(module: torch.nn.Module, save: str = "", freeze: str = "", state: tuple[str, ...] = (),
            region: str = "") -> dict[str, Any]:
    """Keyword arguments for one checkpoint call: a ``context_fn`` for what its region needs.

    ``save="compute"``: keep the outputs of matmul/conv/attention ops (torch's selective
    checkpointing) and recompute only the rest; a write into a kept output raises ``RematError``
    naming ``region`` (``KeptOutputOverwritten``, from ``_KeepGuard``).  ``freeze="modules"``: recompute without updating
    the BatchNorm modules' statistics again (symbolic traces); ``freeze="ops"``: the state is
    written by aten ops in the graph (torch.export), frozen by a dispatch mode that runs them on
    copies.  ``freeze="state"`` with the ``state`` names (parameters or buffers of ``module``):
    any other state the region writes, which it may read back: recomputed from a copy taken in the
    forward, and put back after.  Under torch.compile there is nothing to freeze (AOTAutograd
    applies buffer mutations once, in the forward graph) and dynamo accepts only a
    selective-checkpoint ``context_fn``.
    """
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    save, freeze = Save(save), Freeze(freeze)
    compiling = torch.compiler.is_compiling()
    if compiling:
        freeze = Freeze.NONE
    if not save and not freeze:
        return {}

    def context_fn():
        forward, recompute = contextlib.nullcontext(), contextlib.nullcontext()
        if save:
            forward, recompute = create_selective_checkpoint_contexts(_KeepGuard(region))
            recompute = _Translated(recompute, region)
            if autocast_state():
                forward = _Both(_AutocastCacheOff(), forward)
        # The freezing is entered first: selective checkpointing replays the forward's op sequence
        # exactly, so the freezing's own ops (saving the batch counters) must run outside it.
        if freeze is Freeze.MODULES:
            recompute = _Both(_FrozenBatchNorms(module), recompute)
        elif freeze is Freeze.OPS:
            storages = {id(b.untyped_storage()) for b in module.buffers()}
            recompute = _Both(_FrozenStateMode(storages), recompute)
        elif freeze is Freeze.STATE:
            restored = _RestoredState([_state_tensor(module, name) for name in state])
            forward, recompute = _Both(restored.forward(), forward), _Both(restored.recompute(), recompute)
        return forward, recompute

    if compiling:
        return {"context_fn": functools.partial(create_selective_checkpoint_contexts, _save_compute)}
    return {"context_fn": context_fn}


def freeze_state(module: torch.nn.Module, ops: bool = False) -> dict[str, Any]:
    """The BatchNorm-freezing ``context_fn`` alone (modules generated by remat before ``context``)."""
    return context(module, freeze=Freeze.OPS if ops else Freeze.MODULES)


# --- pickling -----------------------------------------------------------------------------------------
class RematModule(fx.GraphModule):
    """A generated module.  It pickles as its code and state: unpickling a GraphModule re-traces its
    code, which would run the checkpoint calls inline (and drop the grad-mode blocks)."""

    def __reduce__(self) -> tuple[Any, ...]:
        _, (body, import_block) = super().__reduce__()
        return (restore, (body, import_block))


class RestoredModule(torch.nn.Module):
    """A generated module read back from a pickle: its code, submodules, parameters, buffers and
    attributes (``remat_plan`` among them), without the fx graph."""

    def __init__(self, body: dict[str, Any], import_block: str) -> None:
        super().__init__()
        self.__dict__.update(body)
        self._remat_import_block = import_block
        namespace: dict[str, Any] = {}
        exec(compile(import_block + "\n" + self.code, f"<remat {type(self).__name__}>", "exec"), namespace)
        self._remat_forward = namespace["forward"]

    @property
    def code(self) -> str:
        return self.__dict__.get("_code") or self.__dict__["code"]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._remat_forward(self, *args, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        body = {k: v for k, v in self.__dict__.items() if k not in ("_remat_forward", "_remat_import_block")}
        return (restore, (body, self._remat_import_block))


def restore(body: dict[str, Any], import_block: str) -> torch.nn.Module:
    """Read back a pickled generated module (``RematModule.__reduce__``)."""
    return RestoredModule(body, import_block)


# --- files written by ``remat plan --code`` ---------------------------------------------------------
def _share(model: torch.nn.Module, new: torch.nn.Module, path: str) -> None:
    """Put ``model``'s object at ``path`` (a submodule, parameter or buffer) at the same path of
    ``new``, creating empty modules on the way, as fx does for a GraphModule's targets."""
    *parents, leaf = path.split(".")
    src, dst = model, new
    for name in parents:
        src = getattr(src, name)
        if not isinstance(getattr(dst, name, None), torch.nn.Module):
            dst.add_module(name, torch.nn.Module())
        dst = getattr(dst, name)
    value = getattr(src, leaf)
    if getattr(dst, leaf, None) is value:
        return
    if isinstance(value, torch.nn.Module):
        dst.add_module(leaf, value)
    elif isinstance(value, torch.nn.Parameter):
        dst.register_parameter(leaf, value)
    elif isinstance(value, torch.Tensor):
        dst.register_buffer(leaf, value)
    else:
        setattr(dst, leaf, value)


def attach_forward(model: torch.nn.Module, forward: Any, targets: tuple[str, ...],
                   attributes: dict[str, Any] | None = None) -> torch.nn.Module:
    """A module whose forward is ``forward`` (a generated forward, from a ``--code`` file) and whose
    submodules, parameters and buffers at ``targets`` are ``model``'s own objects (shared, not
    copied); ``attributes`` (the input contract, pytree specs) are set on it."""
    cls = type(f"Remat{type(model).__name__}", (torch.nn.Module,), {"forward": forward})
    new = cls()
    # in the model's order (a module before what it holds): the new module lists its parameters in
    # the model's order, under the model's names (tied parameters too)
    order: dict[str, int] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        order.setdefault(prefix, len(order))
        for name, _ in (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)):
            order.setdefault(f"{prefix}.{name}" if prefix else name, len(order))
    for path in sorted(targets, key=lambda p: order.get(p, len(order))):
        _share(model, new, path)
    for name, value in (attributes or {}).items():
        setattr(new, name, value)
    new.training = model.training
    return new

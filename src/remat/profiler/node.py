"""The per-node profile pass: one instrumented training step of a GraphModule on fake tensors.

An ``Interpreter`` runs the forward node by node; a dispatch mode counts every op's FLOPs and
follows its storages (``StorageTracker``); ``saved_tensors_hooks`` see what autograd keeps.  Each
autograd node created by a graph node gets hooks, so the backward that ``loss.backward()`` runs is
attributed to the graph node it belongs to.  The result is written to ``node.meta["remat"]``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.utils._pytree import tree_flatten

from ..step import BWD, FWD, LOSS
from .flops import FlopCounter
from .dispatch import KernelMemory
from .memory import StorageTracker
from .registry import lookup
from .rules import unreturned_writes, written_arguments
from .timing import Machine, op_seconds
from .timing import machine as _machine
from ..trace.modes import MODES_KEY, entered

__all__ = ["NodeProfile", "NodeProfiler", "profile_of"]

META_KEY = "remat"


def draws_random(func: Any, args: tuple, kwargs: dict) -> bool:
    """Does this call draw random numbers?  torch tags such ops ``nondeterministic_seeded``
    (dropout, bernoulli, rand*, fused attention kernels, ...); where the op has a ``dropout_p``
    argument, only a nonzero one draws."""
    if torch.Tag.nondeterministic_seeded not in getattr(func, "tags", ()):
        return False
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == "dropout_p":
            value = kwargs.get("dropout_p", args[i] if i < len(args) else arg.default_value)
            return bool(value)
    return True


@dataclass
class NodeProfile:
    """Costs of one graph node in one training step (bytes and FLOPs)."""

    name: str
    op: str
    target: str
    fwd_flops: int = 0
    bwd_flops: int = 0
    fwd_in: int = 0  # inputs of the node saved for backward
    fwd_tmp: int = 0  # tensors created inside the node (not outputs) saved for backward
    fwd_out: int = 0  # new storages of the outputs
    bwd_tmp: int = 0  # peak temporaries of the node's backward beyond its inputs and outputs
    bwd_out: int = 0  # gradients it produces for its (non-parameter) inputs
    param_grad: int = 0  # bytes of parameter gradients its backward stores (first use of each parameter)
    fwd_transient: int = 0  # peak temporaries of the forward beyond the outputs
    mutates_state: bool = False  # writes a parameter or buffer in place (BatchNorm statistics)
    state_written: frozenset[str] = frozenset()  # the names of those parameters and buffers
    tensor_out: bool = False  # the node's value holds a tensor (else: a size, an int, None, ...)
    random: bool = False  # draws random numbers (dropout): recomputing it must replay the RNG state
    # an op writes a tensor it does not return (rrelu's noise), which its backward may have saved
    # before the write: torch's checkpoint must not stop recomputing early at that save
    writes_saved: bool = False
    # torch's checkpoint stops recomputing a region at the last tensor its forward saved (early
    # stop): what the node's forward runs after its own last save is not run again when nothing
    # later in the region saves.  An op saves its inputs before its kernel runs (a region ending
    # in a matmul does not rerun it), its outputs after.  Parameters count: they are packed too.
    saves: bool = False  # the node's forward saves some tensor for backward
    # the backward reads a tensor the node saved (not so for dead code, or for ops no gradient
    # flows through): torch recomputes a region only when its backward reads such a tensor
    unpacked: bool = False
    tail_time: float = 0.0  # predicted seconds of its forward ops after its last save (all, if none)
    tail_flops: int = 0  # ... and their FLOPs
    tail_keep: int = 0  # ... and the bytes of their kept outputs (keep_bytes): a selective region's
    # recomputation stops before them, so torch's cache keeps those to the region's backward's end
    shape: tuple[int, ...] | None = None  # a placeholder's tensor shape (the planned input shape)
    dtype: str | None = None  # ... and its dtype ("torch.float32")
    fwd_time: float = 0.0  # predicted seconds of its forward ops (timing.py)
    bwd_time: float = 0.0  # predicted seconds of its backward ops
    keep_bytes: int = 0  # new outputs of its matmul/conv/attention ops: what a region saving those keeps
    keep_time: float = 0.0  # seconds of those ops: what recomputing the node skips when they are kept
    selective_time: float = 0.0  # seconds torch's selective checkpoint adds to its forward ops (timing.py)
    # why a region may not keep those outputs ("": it may): a later op writes one in place (GRUCell's
    # in-place gates on its addmm outputs, ``y = lin(x); y.mul_(s)``), and torch's selective
    # checkpoint would hand the overwritten tensor back to the recomputation
    keep_refused: str = ""
    # nodes whose storage this node writes in place (BatchNorm -> relu_): no cut may separate them
    writes_into: frozenset[str] = field(default=frozenset(), repr=False)
    # storage uids (StorageTracker), for stage-level accounting in chain/stages.py
    in_uids: frozenset[int] = field(default=frozenset(), repr=False)
    out_uids: frozenset[int] = field(default=frozenset(), repr=False)  # new storages of the outputs
    value_uids: frozenset[int] = field(default=frozenset(), repr=False)  # every storage of the value
    saved_uids: frozenset[int] = field(default=frozenset(), repr=False)
    # its output tensors that require grad (only these get a gradient in the backward), as (storage
    # uid, offset, shape, stride, bytes): each gets a gradient of its own shape, so a view (vit's
    # class token ``x[:, 0]``: 24 KB of a 4.6 MiB storage) gets one of its size; a tuple's node and
    # its getitem hold the same tensor, counted once
    grad_tensors: frozenset[tuple] = field(default=frozenset(), repr=False)
    # new output storages of its matmul/conv/attention ops (``keep_bytes``): what SAVE_COMPUTE keeps
    keep_uids: frozenset[int] = field(default=frozenset(), repr=False)
    uid_bytes: dict[int, int] = field(default_factory=dict, repr=False)
    # the profile run's allocator timeline (absolute bytes above resident), for stage-level peaks
    fwd_mark: int = field(default=0, repr=False)  # allocated when the node's forward starts
    fwd_peak_mark: int = field(default=0, repr=False)  # highest during it
    bwd_order: int = field(default=-1, repr=False)  # position of its first backward hook (-1: none)
    bwd_mark: int = field(default=0, repr=False)  # allocated when its backward starts
    bwd_peak_mark: int = field(default=0, repr=False)  # highest during its backward


def profile_of(node: fx.Node) -> "NodeProfile":
    """The profile NodeProfiler stored on a node (an error naming the node if it was never profiled)."""
    prof = node.meta.get(META_KEY)
    if prof is None:
        raise ValueError(f"node {node.name} has no profile: run remat.profile (profile_graph) on the graph first")
    return prof


def _target_name(node: fx.Node) -> str:
    if node.op in ("call_module", "get_attr", "call_method", "placeholder", "output"):
        return str(node.target)
    return getattr(node.target, "__name__", str(node.target))


def _tensors(x: Any) -> list[torch.Tensor]:
    flat, _ = tree_flatten(x)
    return [t for t in flat if isinstance(t, torch.Tensor)]


def _new_output_bytes(args: tuple, out: Any) -> int:
    """Bytes of the output storages that are not storages of the inputs."""
    inputs = {id(t.untyped_storage()) for t in _tensors(args)}
    return sum(st.nbytes() for st in {id(t.untyped_storage()): t.untyped_storage() for t in _tensors(out)}.values()
               if id(st) not in inputs)


class NodeProfiler(fx.Interpreter):
    """Runs one training step of ``gm`` on fake tensors and profiles every node."""

    def __init__(self, gm: fx.GraphModule, tracker: StorageTracker, state_names: dict[int, str],
                 machine: Machine | None = None) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.machine = machine or _machine("cpu", 1)
        self.tracker = tracker
        self.flops = FlopCounter()
        self.state_names = state_names  # uid -> name in gm of each parameter and buffer
        self.state_uids = set(state_names)  # parameters and buffers: never activations
        self.profiles: dict[str, NodeProfile] = {}
        self.current: NodeProfile | None = None
        self.unattributed = {FWD: 0, LOSS: 0, BWD: 0}
        self.saved: dict[int, int] = {}  # uid -> bytes of every activation saved for backward
        self._pending_saved: list[torch.Tensor] = []
        self._at_last_save: tuple[float, int, int] | None = None  # (fwd_time, fwd_flops, keep_bytes) of the node then
        self._seen_grad_fns: set[int] = set()
        self._windows: dict[int, int] = {}
        self._bwd_calls = 0
        self._last_bwd: NodeProfile | None = None
        self.grad_owner: dict[int, tuple[torch.Tensor, NodeProfile]] = {}
        self.kept: dict[int, tuple[NodeProfile, str]] = {}  # uid of a matmul/conv/attention output -> node, op

    # --- every op (called by the accounting mode after it) ---------------------------------------
    def observe(self, func: Any, args: tuple, kwargs: dict, out: Any, as_is: bool = True,
                kernel: KernelMemory | None = None) -> None:
        """Count the op's FLOPs and time and note what it writes and draws, for the node running
        now.  ``as_is=False``: a composite op about to run as its parts (seen one by one after this)."""
        prof = self.current
        if prof is not None and self.flops.phase == FWD and draws_random(func, args, kwargs):
            prof.random = True
        if not as_is:
            return
        flops = self.flops.count(func, args, kwargs, out)
        if kernel is not None and kernel.seconds is not None:
            seconds = kernel.seconds
        else:
            seconds = op_seconds(func, flops, (args, kwargs), out, self.machine)
        if prof is None:
            self.unattributed[self.flops.phase] += flops
        elif self.flops.phase == FWD:
            prof.fwd_flops += flops
            prof.fwd_time += seconds
            prof.selective_time += self.machine.selective_op_s
            self.record_writes(prof, func, args, kwargs)
            found = lookup(func)
            if found.formula is not None and found.formula.mac:
                prof.keep_time += seconds
                prof.keep_bytes += _new_output_bytes(args, out)
                inputs = {self.tracker.uid(t) for t in _tensors(args)}
                for t in _tensors(out):
                    uid = self.tracker.uid(t)
                    if uid is not None:
                        self.kept[uid] = (prof, str(func))
                        if uid not in inputs:
                            prof.keep_uids = prof.keep_uids | {uid}
        elif self.flops.phase == BWD:
            prof.bwd_flops += flops
            prof.bwd_time += seconds

    # --- forward -------------------------------------------------------------------------------
    def record_writes(self, prof: NodeProfile, func: Any, args: tuple, kwargs: dict) -> None:
        """Note in-place writes to module state, to storages of earlier nodes and to the outputs of
        matmul/conv/attention ops (directly, through views, or inside a composite's decomposition)."""
        for index, _, value in written_arguments(func, args, kwargs):
            if isinstance(value, torch.Tensor):
                uid = self.tracker.uid(value)
                kept = self.kept.get(uid) if uid is not None else None
                if kept is not None and not kept[0].keep_refused:
                    where = "" if kept[0] is prof else f" (in {prof.name})"
                    kept[0].keep_refused = f"{func}{where} writes in place into the output of {kept[1]}"
                if uid not in self.state_uids and index in unreturned_writes(func):
                    prof.writes_saved = True
                if uid in self.state_uids:
                    prof.mutates_state = True
                    prof.state_written = prof.state_written | {self.state_names[uid]}
                elif uid is not None and uid >= 0:
                    producer = self.tracker.producer.get(uid)
                    if producer is not None and producer != prof.name:
                        prof.writes_into = prof.writes_into | {producer}

    def run_node(self, n: fx.Node) -> Any:
        prof = NodeProfile(n.name, n.op, _target_name(n))
        self.profiles[n.name] = prof
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        inputs = _tensors((args, kwargs))
        in_uids = {u for u in (self.tracker.uid(t) for t in inputs) if u is not None}
        self.current, self.tracker.owner = prof, n.name
        self._pending_saved = []
        self._at_last_save = None
        before = self.tracker.mark()
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack), \
                    entered(n.meta.get(MODES_KEY, ())):
                out = getattr(self, n.op)(n.target, args, kwargs)
        except Exception as e:  # as shape_prop does: say which node, keep the error
            e.add_note(f"remat: while profiling node {n.name!r} ({n.op} {_target_name(n)})")
            raise
        self.current, self.tracker.owner = None, None
        outs = _tensors(out)
        prof.tensor_out = bool(outs)
        if n.op == "placeholder" and isinstance(out, torch.Tensor):
            prof.shape = tuple(int(d) for d in out.shape)
            prof.dtype = str(out.dtype)
        out_uids = {u for u in (self.tracker.uid(t) for t in outs) if u is not None and u >= 0
                    and self.tracker.producer.get(u) == n.name}
        prof.fwd_out = sum(self.tracker.nbytes[u] for u in out_uids)
        prof.fwd_mark, prof.fwd_peak_mark = before, self.tracker.window_peak
        prof.fwd_transient = max(0, self.tracker.window_peak - max(self.tracker.current, before))
        saved = {u for u in (self.tracker.uid(t) for t in self._pending_saved) if u is not None}
        saved -= self.state_uids
        prof.fwd_in = sum(self.tracker.nbytes[u] for u in saved & in_uids)
        prof.fwd_tmp = sum(self.tracker.nbytes[u] for u in saved - in_uids - out_uids)
        prof.bwd_out = sum(t.numel() * t.element_size() for t in inputs
                           if t.requires_grad and self.tracker.uid(t) not in self.state_uids)
        value_uids = {u for u in (self.tracker.uid(t) for t in outs) if u is not None}
        prof.in_uids, prof.out_uids, prof.saved_uids = frozenset(in_uids), frozenset(out_uids), frozenset(saved)
        prof.value_uids = frozenset(value_uids)
        prof.grad_tensors = frozenset(
            (u, int(t.storage_offset()), tuple(map(int, t.shape)), tuple(map(int, t.stride())),
             t.numel() * t.element_size())
            for t, u in ((t, self.tracker.uid(t)) for t in outs if t.requires_grad) if u is not None)
        prof.uid_bytes = {u: self.tracker.nbytes[u] for u in in_uids | value_uids | saved}
        for u in saved:
            self.saved[u] = self.tracker.nbytes[u]
        self._hook_backward(outs, prof)
        prof.saves = self._at_last_save is not None
        seconds, flops, kept = self._at_last_save or (0.0, 0, 0)
        prof.tail_time, prof.tail_flops = max(0.0, prof.fwd_time - seconds), max(0, prof.fwd_flops - flops)
        prof.tail_keep = max(0, prof.keep_bytes - kept)
        self._pending_saved = []
        n.meta[META_KEY] = prof
        return out

    def _pack(self, t: torch.Tensor) -> tuple[NodeProfile | None, torch.Tensor]:
        self._pending_saved.append(t)
        if self.current is not None:  # autograd packs an op's inputs before its kernel runs
            self._at_last_save = (self.current.fwd_time, self.current.fwd_flops, self.current.keep_bytes)
        return self.current, t

    @staticmethod
    def _unpack(packed: tuple[NodeProfile | None, torch.Tensor]) -> torch.Tensor:
        prof, t = packed
        if prof is not None:
            prof.unpacked = True
        return t

    # --- backward attribution ------------------------------------------------------------------
    def _hook_backward(self, outs: list[torch.Tensor], prof: NodeProfile) -> None:
        stack = [t.grad_fn for t in outs if t.grad_fn is not None]
        while stack:
            fn = stack.pop()
            if fn is None or id(fn) in self._seen_grad_fns:
                continue
            self._seen_grad_fns.add(id(fn))
            fn.register_prehook(self._pre_hook(prof))
            fn.register_hook(self._post_hook(prof))
            for nxt, _ in fn.next_functions:
                variable = getattr(nxt, "variable", None)  # AccumulateGrad: a parameter's .grad
                if isinstance(variable, torch.Tensor):
                    # the backward of the last node that uses a parameter creates its gradient first
                    self.grad_owner[id(variable)] = (variable, prof)
                if nxt is not None:
                    stack.append(nxt)

    def _pre_hook(self, prof: NodeProfile):
        def hook(grad_outputs):
            # Ops between two autograd nodes (gradient accumulation) stay with the last owner,
            # and so does the memory they take.
            self.flush_backward()
            self.current, self.tracker.owner = prof, prof.name
            self._windows[id(prof)] = mark = self.tracker.mark()
            if prof.bwd_order < 0:
                prof.bwd_order, prof.bwd_mark = self._bwd_calls, mark
            self._bwd_calls += 1
        return hook

    def _post_hook(self, prof: NodeProfile):
        def hook(grad_inputs, grad_outputs):
            base = self._windows.pop(id(prof), self.tracker.current)
            produced = max(0, self.tracker.current - base)
            prof.bwd_tmp = max(prof.bwd_tmp, self.tracker.window_peak - base - produced)
            prof.bwd_peak_mark = max(prof.bwd_peak_mark, self.tracker.window_peak)
            self._last_bwd = prof
        return hook

    def flush_backward(self) -> None:
        """Charge the peak since the last autograd node to it (gradient accumulation happens there)."""
        if self._last_bwd is not None:
            self._last_bwd.bwd_peak_mark = max(self._last_bwd.bwd_peak_mark, self.tracker.window_peak)

    def finish(self) -> None:
        """After the backward: parameter gradients go to the node whose backward creates them."""
        self.flush_backward()
        for variable, prof in self.grad_owner.values():
            prof.param_grad += variable.numel() * variable.element_size()

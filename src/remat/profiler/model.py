"""``profile(model, example_inputs)``: trace, then one instrumented fake step of the traced graph.

The same run gives the per-node table and the whole-step peak; ``ModelProfile`` carries both.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from torch import fx

from ..step import BWD, FWD, LOSS, run_step
from ..units import fmt_bytes, fmt_flops
from .bound import Bound, OpBound, checkpointing_bound
from .dispatch import ScratchSource, Simulation, Target
from .memory import storage_bytes
from .node import META_KEY, NodeProfile, NodeProfiler
from .timing import machine

__all__ = ["ModelProfile", "profile_graph"]


@dataclass
class ModelProfile:
    """Predicted costs of one training step (docs/design.md), whole model and per graph node."""

    fwd_flops: int
    bwd_flops: int
    param_bytes: int
    buffer_bytes: int
    input_bytes: int
    saved_bytes: int  # activations saved for backward: unique storages, parameters and buffers excluded
    peak_bytes: int  # predicted peak of one training step
    grad_bytes: int  # gradients alive at the end of the step
    nodes: list[NodeProfile] = field(default_factory=list)
    frontend: str = ""
    profile_seconds: float = 0.0
    inlined_peak_bytes: int = 0  # the peak with the model's own checkpoint calls run inline
    workspace_bytes: int = 0  # library workspaces resident on the device (CUDA: cuBLAS's; rules/cuda.py)
    device: str = "cpu"  # the device the step was predicted for
    op_bound_bytes: int = 0  # the most one op reads, writes and allocates at once, above resident (bound.py)
    op_bound_op: str = ""  # that op, and its phase
    # The loss (step.loss_of) between the forward and the backward: its peak above what the
    # forward left allocated (a bf16 output's float32 copy), and the gradient of the output its
    # backward materializes before the graph's own (the bf16 gradient of that copy; an expanded
    # scalar, nothing, for a float32 output).  chain/stages.py charges both to the last stage.
    loss_peak_bytes: int = 0
    loss_grad_bytes: int = 0

    def __post_init__(self) -> None:
        self.inlined_peak_bytes = self.inlined_peak_bytes or self.peak_bytes

    @property
    def resident_bytes(self) -> int:
        return self.param_bytes + self.buffer_bytes + self.input_bytes + self.workspace_bytes

    @property
    def bound(self) -> Bound:
        """The least peak any checkpointing of this step can reach (bound.py)."""
        return checkpointing_bound(self.resident_bytes, self.resident_bytes + self.grad_bytes,
                                   self.op_bound_bytes, self.op_bound_op)

    def table(self, top: int | None = None) -> str:
        """Per-node table (the ``top`` nodes by saved + output bytes, or all) and totals."""
        header = (f"{'node':<28}{'op':<30}{'fwd FLOPs':>11}{'bwd FLOPs':>11}{'fwd_in':>11}{'fwd_tmp':>11}"
                  f"{'fwd_out':>11}{'bwd_tmp':>11}{'bwd_out':>11}")
        rows = [n for n in self.nodes if n.op not in ("placeholder", "output", "get_attr")]
        if top is not None:
            rows = sorted(rows, key=lambda n: -(n.fwd_in + n.fwd_tmp + n.fwd_out))[:top]
        lines = [header, "-" * len(header)]
        for n in rows:
            lines.append(f"{n.name[:27]:<28}{n.target[:29]:<30}{fmt_flops(n.fwd_flops):>11}{fmt_flops(n.bwd_flops):>11}"
                         f"{fmt_bytes(n.fwd_in):>11}{fmt_bytes(n.fwd_tmp):>11}{fmt_bytes(n.fwd_out):>11}"
                         f"{fmt_bytes(n.bwd_tmp):>11}{fmt_bytes(n.bwd_out):>11}")
        lines += ["", f"forward FLOPs  {fmt_flops(self.fwd_flops):>12}    backward FLOPs {fmt_flops(self.bwd_flops):>12}",
                  f"parameters     {fmt_bytes(self.param_bytes):>12}    buffers        {fmt_bytes(self.buffer_bytes):>12}",
                  f"inputs         {fmt_bytes(self.input_bytes):>12}    gradients      {fmt_bytes(self.grad_bytes):>12}",
                  f"saved for bwd  {fmt_bytes(self.saved_bytes):>12}    predicted peak {fmt_bytes(self.peak_bytes):>12}",
                  f"no checkpointing of this code goes below {fmt_bytes(self.bound.bytes)} ({self.bound.reason})"]
        if self.workspace_bytes:
            lines.append(f"workspaces     {fmt_bytes(self.workspace_bytes):>12}    (resident on {self.device}: "
                         "cuBLAS's, kept by torch after the first matmul)")
        return "\n".join(lines)


def profile_graph(gm: fx.GraphModule, args: tuple, kwargs: dict | None = None,
                  target: Target | None = None, scratch: ScratchSource | None = None) -> ModelProfile:
    """Profile one training step of ``gm`` on fake tensors; writes ``node.meta["remat"]``."""
    start = time.perf_counter()
    sim = Simulation(gm, tuple(args), kwargs, target, scratch)
    params = dict(gm.named_parameters(remove_duplicate=False))
    buffers = dict(gm.named_buffers(remove_duplicate=False))
    fake_params = [sim.state[k] for k in params]
    fake_buffers = [sim.state[k] for k in buffers]
    state_names = {sim.tracker.uid(sim.state[k]): k for k in [*buffers, *params]}
    profiler = NodeProfiler(gm, sim.tracker, state_names, machine(sim.target.device.type, sim.target.threads))
    ops = OpBound(sim.tracker)

    def observe(*a: Any, **k: Any) -> None:
        profiler.observe(*a, **k)
        ops.observe(*a, **k)

    def forward() -> Any:
        out = profiler.run(*sim.args) if not sim.kwargs else _run_kwargs(profiler, gm, sim.args, sim.kwargs)
        profiler.env.clear()  # the Interpreter keeps the output node's value; the real step does not
        return out

    # allocated when the loss began and when its backward began; the loss's peak above the first
    marks = {LOSS: 0, BWD: 0, "loss_peak": 0}

    def on_phase(name: str, loss: Any) -> None:
        profiler.flops.phase = name
        if name == LOSS:
            marks[LOSS] = sim.tracker.mark()
        if name == BWD:
            marks.update({"loss_peak": sim.tracker.window_peak - marks[LOSS], BWD: sim.tracker.current})
            if loss is not None:
                ops.backward(loss)

    with sim.running(observer=observe):
        run_step(forward, on_phase)
        ops.finish()
        profiler.finish()
    grads = [t.grad for t in fake_params if t.grad is not None]
    nodes = [n.meta[META_KEY] for n in gm.graph.nodes]
    first_backward = min((n for n in nodes if n.bwd_order >= 0), key=lambda n: n.bwd_order, default=None)
    held = sim.target.allocated  # the device allocator's count of each resident storage
    resident = storage_bytes([*fake_params, *fake_buffers, *sim.inputs], held) + sim.target.workspace
    return ModelProfile(
        fwd_flops=sum(n.fwd_flops for n in nodes) + profiler.unattributed[FWD],
        bwd_flops=sum(n.bwd_flops for n in nodes) + profiler.unattributed[BWD],
        param_bytes=storage_bytes(fake_params, held),
        buffer_bytes=storage_bytes(fake_buffers, held),
        input_bytes=storage_bytes(sim.inputs, held),
        saved_bytes=sum(profiler.saved.values()),
        peak_bytes=resident + sim.tracker.peak,
        grad_bytes=storage_bytes(grads, held),
        nodes=nodes,
        frontend=getattr(gm, "remat_frontend", ""),
        profile_seconds=time.perf_counter() - start,
        workspace_bytes=sim.target.workspace,
        device=sim.target.device.type,
        op_bound_bytes=ops.most,
        op_bound_op=ops.op,
        loss_peak_bytes=max(0, marks["loss_peak"]),
        loss_grad_bytes=max(0, first_backward.bwd_mark - marks[BWD]) if first_backward else 0,
    )


def _run_kwargs(profiler: NodeProfiler, gm: fx.GraphModule, args: tuple, kwargs: dict) -> Any:
    """Interpreter.run takes positional inputs only: order kwargs as the graph's placeholders."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = list(args)
    for n in placeholders[len(args):]:
        if n.target in kwargs:
            values.append(kwargs[n.target])
        elif n.args:
            values.append(n.args[0])  # the placeholder's default
        else:
            raise TypeError(f"missing input {n.target!r}")
    return profiler.run(*values)

"""Random DAG networks for property-based tests and the fuzz benchmark: convolutions, linears on
permuted maps, skips, concatenations, in-place activations, batch/group/layer norm, dropout as a
module and inside the graph, attention with dropout, no_grad and autocast blocks, the model's own
checkpoint calls (both variants), and several outputs.

``INPLACE_OPS`` adds writes into matmul/conv outputs, the outputs a selective region keeps:
composite ops that write their own intermediates in place (GRUCell, LSTMCell, RNNCell and nn.GRU
decompose into addmm, then in-place gates on the addmm outputs or on ``unsafe_split`` chunks of
them: benchmarks/inplace_scan.py lists what does), and
user code that does (``y = lin(x); y.mul_(s)``, ``y += b``, ``relu_``, writes through views and
``unsafe_split`` chunks).  ``ALL_OPS`` is both; ``OPS`` stays the generator earlier seeds drew from."""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as cp
from torch import nn

__all__ = ["OPS", "INPLACE_OPS", "ALL_OPS", "Spec", "random_spec", "FuzzNet"]

OPS = ("conv3", "conv1", "bn", "gn", "relu", "relu_", "gelu", "dropout", "add", "cat", "gate", "linear", "ln",
       "fdropout", "attn", "nograd", "autocast", "ckpt", "ckpt_reentrant")
INPLACE_OPS = ("gru", "lstm", "rnn", "gru_layer", "lin_mul_", "conv_iadd", "conv_relu_", "lin_view_", "lin_unsafe_")
ALL_OPS = OPS + INPLACE_OPS


@dataclass(frozen=True)
class Spec:
    ops: tuple[tuple[str, int, int], ...]  # (op, first input, second input) — indices of earlier values
    outputs: tuple[int, ...]
    channels: int
    seed: int


def random_spec(rng: random.Random, n: int, channels: int = 8, ops: tuple[str, ...] = OPS) -> Spec:
    chosen = []
    for i in range(n):
        op = rng.choice(ops)
        a = i if rng.random() < 0.7 else rng.randint(0, i)  # value i is the output of op i-1 (0: the input)
        b = rng.randint(0, i)
        chosen.append((op, a, b))
    outs = tuple(sorted({n, *rng.sample(range(1, n + 1), k=min(n, rng.randint(0, 2)))}))
    return Spec(tuple(chosen), outs, channels, rng.randint(0, 10**6))


class _Attention(nn.Module):
    """Self-attention along each row of a map, with dropout inside the fused op."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.qkv = nn.Conv2d(c, 3 * c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        rows = self.qkv(x).permute(0, 2, 3, 1).reshape(n * h, 1, w, 3 * c)
        q, k, v = rows.chunk(3, dim=-1)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.2 if self.training else 0.0)
        return a.reshape(n, h, w, c).permute(0, 3, 1, 2)


def _layer(op: str, c: int) -> nn.Module:
    return {
        "conv3": lambda: nn.Conv2d(c, c, 3, padding=1),
        "conv1": lambda: nn.Conv2d(c, c, 1),
        "bn": lambda: nn.BatchNorm2d(c),
        "gn": lambda: nn.GroupNorm(2, c),
        "cat": lambda: nn.Conv2d(2 * c, c, 1),
        "gate": lambda: nn.Conv2d(c, c, 1),
        "linear": lambda: nn.Linear(c, c),
        "ln": lambda: nn.LayerNorm(c),
        "dropout": lambda: nn.Dropout(0.2),
        "attn": lambda: _Attention(c),
        "nograd": lambda: nn.Conv2d(c, c, 3, padding=1),
        "autocast": lambda: nn.Conv2d(c, c, 1),
        "ckpt": lambda: nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.ReLU(), nn.Conv2d(c, c, 1)),
        "ckpt_reentrant": lambda: nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.GELU(), nn.Conv2d(c, c, 1)),
        "gru": lambda: nn.GRUCell(c, c),
        "lstm": lambda: nn.LSTMCell(c, c),
        "rnn": lambda: nn.RNNCell(c, c),
        "gru_layer": lambda: nn.GRU(c, c, batch_first=True),
        "lin_mul_": lambda: nn.Linear(c, c),
        "conv_iadd": lambda: nn.Conv2d(c, c, 1),
        "conv_relu_": lambda: nn.Conv2d(c, c, 3, padding=1),
        "lin_view_": lambda: nn.Linear(c, c),
        "lin_unsafe_": lambda: nn.Linear(c, c),
    }.get(op, nn.Identity)()


def _rows(x: torch.Tensor) -> torch.Tensor:
    """A map (N, C, H, W) as rows of C features (what a cell or a linear layer takes)."""
    return x.permute(0, 2, 3, 1).reshape(-1, x.shape[1])


def _map(rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    n, c, h, w = like.shape
    return rows.reshape(n, h, w, c).permute(0, 3, 1, 2)


def _inplace(op: str, layer: nn.Module, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The INPLACE_OPS: each writes into a matmul/conv output after it is made."""
    c = u.shape[1]
    if op == "gru":
        return _map(layer(_rows(u), _rows(v)), u)
    if op == "lstm":
        h, cell = layer(_rows(u), (_rows(v), _rows(u)))
        return _map(h + cell, u)
    if op == "rnn":
        return _map(layer(_rows(u), _rows(v)), u)
    if op == "gru_layer":  # each row of the map a sequence; the CPU runs the cells one by one
        n, _, h, w = u.shape
        out, _ = layer(u.permute(0, 2, 3, 1).reshape(n * h, w, c))
        return out.reshape(n, h, w, c).permute(0, 3, 1, 2)
    if op == "lin_mul_":
        y = layer(_rows(u))
        y.mul_(0.5)
        return _map(y, u)
    if op == "conv_iadd":
        y = layer(u)
        y += v
        return y
    if op == "conv_relu_":
        return torch.relu_(layer(u))
    if op == "lin_view_":
        y = layer(_rows(u))
        y[:, : c // 2].mul_(2.0)  # through a view
        return _map(y, u)
    if op == "lin_unsafe_":
        y = layer(_rows(u))
        first, *_ = torch.unsafe_split(y, max(1, c // 2), dim=1)  # chunks autograd does not track
        first.add_(1.0)
        return _map(torch.tanh(y), u)
    raise ValueError(op)


class FuzzNet(nn.Module):
    """Value 0 is the input; op i produces value i + 1 from values ``a`` and ``b``."""

    def __init__(self, spec: Spec) -> None:
        super().__init__()
        torch.manual_seed(spec.seed)
        self.spec = spec
        self.layers = nn.ModuleList(_layer(op, spec.channels) for op, _, _ in spec.ops)

    def forward(self, x):
        values = [x]
        for (op, a, b), layer in zip(self.spec.ops, self.layers):
            u, v = values[a], values[b]
            if op in ("conv3", "conv1", "bn", "gn", "dropout", "attn"):
                y = layer(u)
            elif op == "relu":
                y = torch.relu(u)
            elif op == "relu_":
                y = (u * 1.0).relu_()  # in place on a fresh tensor (mul saves nothing)
            elif op == "gelu":
                y = F.gelu(u)
            elif op == "add":
                y = u + v
            elif op == "cat":
                y = layer(torch.cat([u, v], dim=1))
            elif op == "gate":
                y = u * torch.sigmoid(layer(v))
            elif op in ("linear", "ln"):
                y = layer(u.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
            elif op == "fdropout":
                y = F.dropout(u, 0.3, training=self.training)
            elif op == "nograd":  # a frozen feature path and a stop-gradient scale
                with torch.no_grad():
                    s = layer(u).abs().mean() + 1
                y = u / s
            elif op == "autocast":
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    h = layer(u)
                y = h.float()
            elif op == "ckpt":
                y = cp.checkpoint(layer, u, use_reentrant=False)
            elif op in INPLACE_OPS:
                y = _inplace(op, layer, u, v)
            elif op == "ckpt_reentrant":  # (on an input that needs no gradient PyTorch would drop the
                # gradients of the layer inside, a difference remat warns about: keep to defined cases)
                y = cp.checkpoint(layer, u, use_reentrant=u.requires_grad)
            else:
                raise ValueError(op)
            values.append(y)
        outs = tuple(values[i] for i in self.spec.outputs)
        return outs if len(outs) > 1 else outs[0]

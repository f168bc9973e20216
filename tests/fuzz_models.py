"""Random DAG networks for property-based tests: convolutions, linears, skips, concatenations,
in-place activations, dropout, batch/layer norm and several outputs."""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch import nn

OPS = ("conv3", "conv1", "bn", "gn", "relu", "relu_", "gelu", "dropout", "add", "cat", "gate", "linear", "ln")


@dataclass(frozen=True)
class Spec:
    ops: tuple[tuple[str, int, int], ...]  # (op, first input, second input) — indices of earlier values
    outputs: tuple[int, ...]
    channels: int
    seed: int


def random_spec(rng: random.Random, n: int, channels: int = 8) -> Spec:
    ops = []
    for i in range(n):
        op = rng.choice(OPS)
        a = i if rng.random() < 0.7 else rng.randint(0, i)  # value i is the output of op i-1 (0: the input)
        b = rng.randint(0, i)
        ops.append((op, a, b))
    outs = tuple(sorted({n, *rng.sample(range(1, n + 1), k=min(n, rng.randint(0, 2)))}))
    return Spec(tuple(ops), outs, channels, rng.randint(0, 10**6))


class FuzzNet(nn.Module):
    """Value 0 is the input; op i produces value i + 1 from values ``a`` and ``b``."""

    def __init__(self, spec: Spec) -> None:
        super().__init__()
        torch.manual_seed(spec.seed)
        c = spec.channels
        self.spec = spec
        layers = []
        for op, _, _ in spec.ops:
            layers.append({
                "conv3": lambda: nn.Conv2d(c, c, 3, padding=1),
                "conv1": lambda: nn.Conv2d(c, c, 1),
                "bn": lambda: nn.BatchNorm2d(c),
                "gn": lambda: nn.GroupNorm(2, c),
                "cat": lambda: nn.Conv2d(2 * c, c, 1),
                "gate": lambda: nn.Conv2d(c, c, 1),
                "linear": lambda: nn.Linear(c, c),
                "ln": lambda: nn.LayerNorm(c),
                "dropout": lambda: nn.Dropout(0.2),
            }.get(op, nn.Identity)())
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        values = [x]
        for (op, a, b), layer in zip(self.spec.ops, self.layers):
            u, v = values[a], values[b]
            if op in ("conv3", "conv1", "bn", "gn", "dropout"):
                y = layer(u)
            elif op == "relu":
                y = torch.relu(u)
            elif op == "relu_":
                y = (u * 1.0).relu_()  # in place on a fresh tensor (mul saves nothing)
            elif op == "gelu":
                y = nn.functional.gelu(u)
            elif op == "add":
                y = u + v
            elif op == "cat":
                y = layer(torch.cat([u, v], dim=1))
            elif op == "gate":
                y = u * torch.sigmoid(layer(v))
            elif op in ("linear", "ln"):
                y = layer(u.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
            else:
                raise ValueError(op)
            values.append(y)
        outs = tuple(values[i] for i in self.spec.outputs)
        return outs if len(outs) > 1 else outs[0]

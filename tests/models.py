"""Small models that exercise the corners the profiler, codegen and solvers must get right."""
from __future__ import annotations

import torch
from torch import nn


class ViewsAndInplace(nn.Module):
    """Views, in-place activations and in-place adds on views."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 64)

    def forward(self, x):
        y = self.a(x).relu_()
        z = y.view(-1, 8, 8).transpose(1, 2)
        z = z.reshape(-1, 64)
        w = self.b(z)
        w.add_(y)
        return w.t().contiguous().sigmoid()


class SharedParams(nn.Module):
    """One Linear applied twice and a tied output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 32)
        self.block = nn.Linear(32, 32)
        self.out = nn.Linear(32, 100, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids):
        h = self.emb(ids)
        h = torch.tanh(self.block(h))
        h = torch.tanh(self.block(h)) + h
        return self.out(h)


class MultiOutput(nn.Module):
    """A tuple with two float outputs and an integer one."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True))
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        f = self.body(x)
        pooled = f.mean(dim=(2, 3))
        logits = self.head(pooled)
        return logits, f, logits.argmax(-1)


class DictOutput(nn.Module):
    """A dict of outputs, one of which is a view of another."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 32))

    def forward(self, x):
        h = self.enc(x)
        return {"hidden": h, "first": h[:, 0], "score": (h * x).sum(-1)}


def traced_chain(model: nn.Module, inputs: tuple, shared: tuple[str, ...] = ()):
    """The trace of ``model``, profiled, and its linearization (test_chain.py, test_codegen.py)."""
    import remat
    from remat.chain import linearize
    from remat.profiler.model import profile_graph

    gm = remat.trace(model, inputs)
    profile_graph(gm, inputs)
    return gm, linearize(gm, shared)

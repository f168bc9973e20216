"""Small models with the patterns that broke remat on models nobody here wrote: state a forward
writes and reads back, hooks, random draws of every kind, a recurrent layer.  The tests pin each
fix on them; ``benchmarks/wild.py`` runs them at a size where checkpointing matters."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SpectralNet", "KeyQueue", "Hooked", "RandomDraws", "RANDOM_DRAWS", "Recurrent", "CellChain"]


class SpectralNet(nn.Module):
    """Spectral norm's power iteration writes ``_u``/``_v`` in place (through ``out=``), then builds
    the weight from them: a recomputation that sees the updated vectors computes another weight.
    ``order`` lists the layer applied at each step (repeat one to share it between regions)."""

    def __init__(self, width: int = 32, order: tuple[int, ...] = (0, 1, 2, 3)) -> None:
        super().__init__()
        sn = nn.utils.parametrizations.spectral_norm
        self.layers = nn.ModuleList([sn(nn.Linear(width, width)) for _ in range(max(order) + 1)])
        self.order = order

    def forward(self, x):
        for i in self.order:
            x = torch.tanh(self.layers[i](x)) + x
        return x


class KeyQueue(nn.Module):
    """MoCo-style: each step writes its keys into a queue buffer, then scores against the queue.
    symbolic_trace cannot trace the slice assignment; torch.export pins the batch when it fills
    the queue (a batch of ``size``)."""

    def __init__(self, dim: int = 16, size: int = 8, depth: int = 4) -> None:
        super().__init__()
        self.enc = nn.Sequential(*[nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(depth)])
        self.register_buffer("queue", torch.randn(dim, size))

    def forward(self, x):
        q = self.enc(x)
        with torch.no_grad():
            self.queue[:, :x.shape[0]] = q.detach().T
        return (q @ self.queue).logsumexp(1)


class Hooked(nn.Module):
    """Residual blocks; hooks are registered on ``blocks[i]`` by the caller."""

    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))
                                     for _ in range(depth)])

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x


# random draws of every kind a model makes: tensor factories, in-place fills, sampling, activations
RANDOM_DRAWS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "randn_like": lambda x: x + 0.1 * torch.randn_like(x),
    "rand": lambda x: x * (torch.rand(x.shape[0], 1) > 0.3),
    "bernoulli_": lambda x: x * torch.empty_like(x).bernoulli_(0.7),
    "normal": lambda x: x + torch.normal(0.0, 0.1, size=x.shape),
    "uniform_": lambda x: x * torch.empty_like(x).uniform_(0.5, 1.5),
    "exponential_": lambda x: x * torch.empty_like(x).exponential_(),
    "randperm": lambda x: x[:, torch.randperm(x.shape[1])],
    "multinomial": lambda x: x[torch.multinomial(torch.ones(x.shape[0]), x.shape[0], replacement=True)],
    "rrelu": lambda x: F.rrelu(x, training=True),
    "dropout1d": lambda x: F.dropout1d(x.unsqueeze(0), 0.3, training=True).squeeze(0),
    "alpha_dropout": lambda x: F.alpha_dropout(x, 0.3, training=True),
    "gumbel_softmax": lambda x: F.gumbel_softmax(x, tau=1.0),
}


class RandomDraws(nn.Module):
    """A linear layer and a tanh before each draw of ``RANDOM_DRAWS``."""

    def __init__(self, width: int = 32, draws: tuple[str, ...] = tuple(RANDOM_DRAWS)) -> None:
        super().__init__()
        self.draws = draws
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in draws])

    def forward(self, x):
        for layer, draw in zip(self.layers, self.draws):
            x = RANDOM_DRAWS[draw](torch.tanh(layer(x)))
        return x


class Recurrent(nn.Module):
    """Embedding, a 2-layer LSTM (one graph node: no checkpoint splits it), a linear head."""

    def __init__(self, vocab: int = 100, width: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.lstm = nn.LSTM(width, hidden, 2, batch_first=True)
        self.head = nn.Linear(hidden, 4)

    def forward(self, x):
        return self.head(self.lstm(self.emb(x))[0]).mean(1)


class CellChain(nn.Module):
    """One recurrent cell (GRUCell, LSTMCell or RNNCell: shared weights) applied ``steps`` times to
    its hidden state.  On the CPU each call decomposes into addmm and then in-place gates on the
    addmm outputs (through ``unsafe_split`` chunks, which torch's version counters do not see): a
    selective region that keeps those outputs would recompute from overwritten values."""

    def __init__(self, cell: type[nn.Module] = nn.GRUCell, width: int = 32, steps: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.cell = cell(width, width)
        self.steps = steps
        self.head = nn.Linear(width, width)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        c = h
        for _ in range(self.steps):
            if isinstance(self.cell, nn.LSTMCell):
                h, c = self.cell(x, (h, c))
            else:
                h = self.cell(x, h)
        return self.head(h)

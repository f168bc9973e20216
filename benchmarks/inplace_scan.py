"""Which torch ops and layers write into their own matmul/conv/attention outputs in place.

A region that keeps those outputs (torch's selective checkpointing) must not keep one a later op
overwrites: remat's profile refuses such regions (``NodeProfile.keep_refused``).  This scans the
composite ops and layers a model is built from on the CPU, recording, under a dispatch mode, every
write into the storage of an earlier multiply-add op's output (directly, through a view, or
through an ``unsafe_split`` chunk, which torch's version counters do not see).  What it finds is
what ``remat.testing.fuzz.INPLACE_OPS`` must cover.

    python benchmarks/inplace_scan.py
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from remat.profiler.registry import lookup
from remat.profiler.rules import written_arguments

from common import md_table, write_result


class Writes(TorchDispatchMode):
    """Records (writer, kept op) for each write into a multiply-add op's output."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: dict[int, str] = {}  # StorageImpl address -> op (the outputs are held: no reuse)
        self.held: list[torch.Tensor] = []
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for _, _, value in written_arguments(func, args, kwargs):
            if isinstance(value, torch.Tensor) and value.untyped_storage()._cdata in self.kept:
                self.found.append(f"{func} into {self.kept[value.untyped_storage()._cdata]}")
        out = func(*args, **kwargs)
        formula = lookup(func).formula
        if formula is not None and formula.mac:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.kept[t.untyped_storage()._cdata] = str(func)
                    self.held.append(t)
        return out


def cases() -> dict[str, callable]:
    x2, x3 = torch.randn(4, 8), torch.randn(2, 5, 8)
    img, seq = torch.randn(2, 4, 9, 9), torch.randn(2, 4, 12)
    mask = torch.ones(5, 5).tril().bool()
    return {
        "nn.Linear, 2-D": lambda: nn.Linear(8, 8)(x2),
        "nn.Linear, 3-D contiguous": lambda: nn.Linear(8, 8)(x3),
        "nn.Linear, 3-D permuted": lambda: nn.Linear(5, 8)(x3.transpose(1, 2)),
        "nn.Bilinear": lambda: nn.Bilinear(8, 8, 4)(x2, x2),
        "nn.GRUCell": lambda: nn.GRUCell(8, 8)(x2),
        "nn.LSTMCell": lambda: nn.LSTMCell(8, 8)(x2),
        "nn.RNNCell tanh": lambda: nn.RNNCell(8, 8)(x2),
        "nn.RNNCell relu": lambda: nn.RNNCell(8, 8, nonlinearity="relu")(x2),
        "nn.GRU": lambda: nn.GRU(8, 8, batch_first=True)(x3),
        "nn.LSTM": lambda: nn.LSTM(8, 8, batch_first=True)(x3),
        "nn.LSTM, proj_size": lambda: nn.LSTM(8, 8, batch_first=True, proj_size=4)(x3),
        "nn.RNN": lambda: nn.RNN(8, 8, batch_first=True)(x3),
        "nn.MultiheadAttention": lambda: nn.MultiheadAttention(8, 2, batch_first=True)(x3, x3, x3),
        "nn.MultiheadAttention, mask, no weights": lambda: nn.MultiheadAttention(8, 2, batch_first=True)(
            x3, x3, x3, attn_mask=mask, need_weights=False),
        "nn.TransformerEncoderLayer": lambda: nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)(x3),
        "nn.TransformerDecoderLayer": lambda: nn.TransformerDecoderLayer(8, 2, 16, batch_first=True)(x3, x3),
        "nn.Conv1d": lambda: nn.Conv1d(4, 4, 3)(seq),
        "nn.Conv2d, padding same": lambda: nn.Conv2d(4, 4, 4, padding="same")(img),
        "nn.Conv2d + ReLU(inplace)": lambda: nn.Sequential(nn.Conv2d(4, 4, 3), nn.ReLU(inplace=True))(img),
        "nn.ConvTranspose2d": lambda: nn.ConvTranspose2d(4, 4, 3)(img),
        "nn.ConvTranspose2d, output_padding": lambda: nn.ConvTranspose2d(4, 4, 3, stride=2, output_padding=1)(img),
        "F.scaled_dot_product_attention": lambda: F.scaled_dot_product_attention(x3[None], x3[None], x3[None]),
        "F.scaled_dot_product_attention, mask": lambda: F.scaled_dot_product_attention(
            x3[None], x3[None], x3[None], attn_mask=mask),
        "F.scaled_dot_product_attention, causal, dropout": lambda: F.scaled_dot_product_attention(
            x3[None], x3[None], x3[None], is_causal=True, dropout_p=0.1),
        "torch.matmul, broadcast": lambda: torch.matmul(x3, torch.randn(8, 3)),
        "torch.einsum": lambda: torch.einsum("bsd,btd->bst", x3, x3),
        "torch.baddbmm": lambda: torch.baddbmm(torch.randn(2, 5, 5), x3, x3.transpose(1, 2)),
        "torch.addbmm": lambda: torch.addbmm(torch.randn(5, 5), x3, x3.transpose(1, 2)),
        "torch.linalg.multi_dot": lambda: torch.linalg.multi_dot([x2, torch.randn(8, 8), torch.randn(8, 3)]),
        "torch.tensordot": lambda: torch.tensordot(x3, torch.randn(8, 3), dims=1),
        "torch.cdist": lambda: torch.cdist(x3, x3),
        "nn.EmbeddingBag": lambda: nn.EmbeddingBag(10, 8)(torch.randint(0, 10, (2, 4))),
    }


def main() -> int:
    rows = []
    for name, run in cases().items():
        torch.manual_seed(0)
        mode = Writes()
        with mode:
            run()
        rows.append((name, "; ".join(dict.fromkeys(mode.found)) or "none"))
        print(rows[-1], flush=True)
    table = md_table(("op or layer (CPU, float32, with autograd)", "writes into a multiply-add output"), rows)
    write_result("inplace_scan.md", "Ops that write into their own matmul/conv/attention outputs",
                 ["Each case run under a dispatch mode recording every write into the storage of an earlier "
                  "multiply-add op's output (remat's FLOP registry: `formula.mac`). These are the writes a "
                  "selective region must not keep through; `remat.testing.fuzz.INPLACE_OPS` covers them.", table])
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

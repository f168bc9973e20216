"""Random single-op and small-block configurations for benchmarks/opfuzz.py: one builder per family,
``build(rng) -> Case``. Shapes, parameters, layout, dtype, requires_grad and frozen parameters come from
``rng``, tensor values from torch's global generator (the caller seeds both); ``desc`` says what it is."""
from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

CAP = 1 << 22  # elements of the largest activation of one configuration (16 MiB in float32)


@dataclass
class Case:
    family: str
    desc: str
    model: nn.Module
    inputs: tuple


class Fn(nn.Module):
    """A module around a function of (module, *inputs), with optional parameters in ``params``."""

    def __init__(self, fn: Callable, **params: nn.Parameter) -> None:
        super().__init__()
        self.fn, self.params = fn, nn.ParameterDict(params)

    def forward(self, *xs):
        return self.fn(self, *xs)


def dtype_of(rng: random.Random) -> torch.dtype:
    return torch.bfloat16 if rng.random() < 0.3 else torch.float32


def tensor(rng: random.Random, shape: list[int], dtype: torch.dtype, rg: bool,
           layouts: tuple[str, ...] = ("contig",)) -> tuple[torch.Tensor, str]:
    """A random input of ``shape`` in a layout drawn from ``layouts``: contig, cl (channels_last /
    channels_last_3d), perm (a permuted view of a differently ordered storage), slice (every
    other element of the last dim); returns it and a short description."""
    layout = rng.choice([lay for lay in layouts if lay != "cl" or len(shape) in (4, 5)])
    if layout == "cl":
        x = torch.randn(shape, dtype=dtype).contiguous(memory_format=[torch.channels_last, torch.channels_last_3d][len(shape) - 4])
    elif layout == "perm" and len(shape) > 1:
        order = list(range(len(shape)))
        while order == sorted(order):
            rng.shuffle(order)
        x = torch.randn([shape[i] for i in order], dtype=dtype).permute([order.index(i) for i in range(len(shape))])
        layout = f"perm{tuple(order)}"
    elif layout == "slice":
        x = torch.randn(shape[:-1] + [2 * shape[-1]], dtype=dtype)[..., ::2]
    else:
        x, layout = torch.randn(shape, dtype=dtype), "contig"
    x.requires_grad_(rg)
    return x, f"x{tuple(shape)} {layout} {str(dtype)[6:]} rg={rg}"


def finish(rng: random.Random, family: str, desc: str, model: nn.Module, inputs: tuple,
           dtype: torch.dtype) -> Case:
    """Cast the model, maybe freeze all or some of its parameters, and describe the result."""
    model = model.to(dtype).train()
    params, frozen = list(model.named_parameters()), "none"
    if params and rng.random() < 0.15:
        frozen = "all"
        [p.requires_grad_(False) for _, p in params]
    elif len(params) > 1 and rng.random() < 0.15:
        frozen, p = rng.choice(params)
        p.requires_grad_(False)
    return Case(family, f"{desc}; frozen={frozen}", model, inputs)


def fit(shape: list[int], cap: int = CAP, keep: int = 2) -> list[int]:
    """Halve the largest of the dims after the first ``keep`` (then the batch) until it fits."""
    shape = list(shape)
    while math.prod(shape) > cap:
        i = max(list(range(keep, len(shape))) or [0], key=lambda j: shape[j])
        i = i if shape[i] > 1 else 0
        if shape[i] == 1:
            return shape
        shape[i] //= 2
    return shape


def channels(rng: random.Random) -> int:
    return rng.choice([rng.randint(1, 8), rng.randint(9, 64), rng.randint(65, 512), rng.choice([3, 16, 32, 64, 128, 256])])


def conv(rng: random.Random) -> Case:
    d, transposed = rng.choice([1, 2, 2, 2, 3]), rng.random() < 0.25
    cin = channels(rng)
    kind = rng.choice(["1", "dw", "mid"])
    divisors = [g for g in range(2, cin) if cin % g == 0]
    if kind == "dw":
        groups, cout = cin, cin * rng.choice([1, 1, 2, 3])
    elif kind == "mid":
        groups = rng.choice(divisors) if divisors else 1
        cout = groups * rng.randint(1, max(1, 256 // groups))
    else:
        groups, cout = 1, channels(rng)
    k = [rng.choice([1, 2, 3, 3, 5, 7] if d < 3 else [1, 2, 3, 3, 5]) for _ in range(d)]
    k = [k[0]] * d if rng.random() < 0.7 else k
    while cin // groups * cout * math.prod(k) > (1 << 21):  # at most 2M weights
        cout, k = (max(groups, cout // 2 // groups * groups), k) if cout > groups else (cout, [max(1, x - 2) for x in k])
    dil = rng.choice([1, 1, 1, 2, 3, rng.randint(2, 36 if d == 2 else 8)])
    stride = rng.choice([1, 1, 1, 2, 3]) if rng.random() < 0.8 else rng.randint(1, 4)
    padmode = rng.choice(["rand", "rand", "half"] + (["same"] if not transposed and stride == 1 else []))
    outpad = rng.randint(0, max(stride, dil) - 1) if transposed and rng.random() < 0.3 else 0
    batch = rng.randint(1, 8)
    size = [rng.randint(2, {1: 512, 2: 72, 3: 18}[d]) for _ in range(d)]
    praw = [rng.random() for _ in range(d)]

    def geometry() -> tuple[list[int], list[int], int]:
        eff = [dil * (x - 1) + 1 for x in k]
        pad = [e // 2 if padmode == "half" else int(r * (e // 2 + 1)) for e, r in zip(eff, praw)]
        if transposed:
            out = [(s - 1) * stride - 2 * p + e + outpad for s, p, e in zip(size, pad, eff)]
        elif padmode == "same":
            out = size
        else:  # the padded input must cover the dilated kernel
            pad = [max(min(p, e // 2), -(-(e - s) // 2)) for p, s, e in zip(pad, size, eff)]
            out = [(s + 2 * p - e) // stride + 1 for s, p, e in zip(size, pad, eff)]
        macs = batch * cout * math.prod(out) * cin // groups * math.prod(k)
        return pad, out, max(batch * cin * math.prod(size), batch * cout * math.prod(out), macs // 20)

    pad, out, cost = geometry()
    while cost > CAP and max(size + [batch] + k) > 1:  # halve the largest spatial size, then the batch, then the kernel
        if max(size) > 1:
            size[size.index(max(size))] //= 2
        else:
            batch, k = (batch // 2, k) if batch > 1 else (batch, [max(1, x - 1) for x in k])
        pad, out, cost = geometry()
    bias, dtype = rng.random() < 0.6, dtype_of(rng)
    cls = getattr(nn, f"Conv{'Transpose' if transposed else ''}{d}d")
    padding: str | tuple = "same" if padmode == "same" else tuple(pad)
    model = cls(cin, cout, tuple(k), stride=stride, padding=padding, dilation=dil, groups=groups, bias=bias,
                **({"output_padding": outpad} if transposed else {}))
    x, xd = tensor(rng, [batch, cin] + size, dtype, rng.random() < 0.5, ("contig", "contig", "cl", "slice"))
    desc = (f"{cls.__name__}(in={cin}, out={cout}, k={tuple(k)}, s={stride}, p={padding!r}, d={dil}, g={groups}, "
            f"bias={bias}{f', outpad={outpad}' if transposed else ''}) {xd} -> out{tuple(out)}")
    if d > 1 and rng.random() < 0.2:
        model = model.to(memory_format=torch.channels_last if d == 2 else torch.channels_last_3d)
        desc += " weight=channels_last"
    return finish(rng, "conv", desc, model, (x,), dtype)


def pool(rng: random.Random) -> Case:
    d, kind = rng.choice([1, 2, 2, 3]), rng.choice(["max", "max", "avg", "amax", "aavg"])
    batch, c = rng.randint(1, 8), channels(rng)
    shape = fit([batch, c] + [rng.randint(4, {1: 512, 2: 96, 3: 20}[d]) for _ in range(d)])
    spatial = shape[2:]
    if kind in ("amax", "aavg"):
        out = [rng.choice([1, 2, 3, 5, 7, max(1, s // 2), s + rng.randint(0, 3)]) for s in spatial]
        idx, cls = kind == "amax" and rng.random() < 0.5, getattr(nn, f"Adaptive{'Max' if kind == 'amax' else 'Avg'}Pool{d}d")
        model = cls(out, return_indices=True) if idx else cls(out)
        desc = f"{cls.__name__}(out={tuple(out)}{', return_indices' if idx else ''})"
    else:
        k = rng.randint(1, min(7, min(spatial)))
        s, p, ceil = rng.choice([None, 1, 2, k]), rng.randint(0, k // 2), rng.random() < 0.4
        if kind == "max":
            dil, idx = rng.choice([1, 1, 2]) if k * 2 <= min(spatial) else 1, rng.random() < 0.4
            model = getattr(nn, f"MaxPool{d}d")(k, s, p, dil, return_indices=idx, ceil_mode=ceil)
            desc = f"MaxPool{d}d(k={k}, s={s}, p={p}, d={dil}, ceil={ceil}, indices={idx})"
        else:
            cip = rng.random() < 0.5
            model = getattr(nn, f"AvgPool{d}d")(k, s, p, ceil_mode=ceil, count_include_pad=cip)
            desc = f"AvgPool{d}d(k={k}, s={s}, p={p}, ceil={ceil}, count_include_pad={cip})"
    x, xd = tensor(rng, shape, dtype := dtype_of(rng), rng.random() < 0.85, ("contig", "contig", "cl", "slice", "perm"))
    return finish(rng, "pool", f"{desc} {xd}", model, (x,), dtype)


def interp(rng: random.Random) -> Case:
    mode = rng.choice(["nearest", "nearest-exact", "linear", "bilinear", "bilinear", "bicubic", "trilinear", "area"])
    d = {"linear": 1, "bilinear": 2, "bicubic": 2, "trilinear": 3}.get(mode, rng.choice([1, 2, 3]))
    shape = [rng.randint(1, 8), channels(rng) if rng.random() < 0.5 else rng.randint(1, 16)] + \
        [rng.randint(2, {1: 256, 2: 64, 3: 16}[d]) for _ in range(d)]
    kw: dict = {}
    if rng.random() < 0.5:
        sf = [rng.choice([0.5, 0.75, 1.5, 2.0, 2.0, 3.0, 4.0, 1.3])] * d
        kw["scale_factor"] = tuple(sf) if rng.random() < 0.5 else sf[0]
        kw.update({"recompute_scale_factor": True} if rng.random() < 0.3 else {})
        out = [int(s * f) for s, f in zip(shape[2:], sf)]
    else:
        out = [max(1, int(s * rng.uniform(0.3, 3.5))) for s in shape[2:]]
        kw["size"] = tuple(out)
    if mode in ("linear", "bilinear", "bicubic", "trilinear"):
        kw["align_corners"] = rng.random() < 0.5
    if mode in ("bilinear", "bicubic") and rng.random() < 0.2:
        kw["antialias"] = True
    shape = fit(shape, int(CAP / max(1.0, math.prod(max(1, o) for o in out) / math.prod(shape[2:]))))
    x, xd = tensor(rng, shape, dtype := dtype_of(rng), rng.random() < 0.85, ("contig", "contig", "cl", "slice"))
    return finish(rng, "interp", f"F.interpolate(mode={mode}, {kw}) {xd}", Fn(lambda m, x: F.interpolate(x, mode=mode, **kw)),
                  (x,), dtype)


def norm(rng: random.Random) -> Case:
    kind = rng.choice(["bn", "bn", "ln", "ln", "gn", "in"])
    batch, c = rng.randint(1, 8), channels(rng)
    d = rng.choice([0, 1, 2, 2, 3]) if kind == "bn" else rng.choice([1, 2, 2, 3])
    shape = fit([max(2, batch), c] + [rng.randint(2, {0: 1, 1: 512, 2: 64, 3: 16}[d]) for _ in range(d)])
    affine = rng.random() < 0.8
    if kind == "bn":
        track = rng.random() < 0.8
        model: nn.Module = getattr(nn, f"BatchNorm{max(1, d)}d")(c, affine=affine, track_running_stats=track,
                                                                  momentum=None if rng.random() < 0.15 else 0.1)
        desc = f"BatchNorm{max(1, d)}d({c}, affine={affine}, track={track}, momentum={model.momentum})"
    elif kind == "ln":
        nd, bias = rng.randint(1, min(3, len(shape) - 1)), rng.random() < 0.8
        model = nn.LayerNorm(shape[-nd:], elementwise_affine=affine, bias=bias)
        desc = f"LayerNorm({shape[-nd:]}, affine={affine}, bias={bias})"
    elif kind == "gn":
        g = rng.choice([x for x in range(1, c + 1) if c % x == 0])
        model = nn.GroupNorm(g, c, affine=affine)
        desc = f"GroupNorm({g}, {c}, affine={affine})"
    else:
        shape = fit([shape[0], c] + [max(2, s) for s in shape[2:]])
        track = rng.random() < 0.3
        model = getattr(nn, f"InstanceNorm{d}d")(c, affine=affine, track_running_stats=track)
        desc = f"InstanceNorm{d}d({c}, affine={affine}, track={track})"
    x, xd = tensor(rng, shape, dtype := dtype_of(rng), rng.random() < 0.6, ("contig", "contig", "cl", "perm", "slice"))
    return finish(rng, "norm", f"{desc} {xd}", model, (x,), dtype)


def embedding(rng: random.Random) -> Case:
    num, dim = rng.choice([rng.randint(2, 100), rng.randint(100, 5000), rng.randint(5000, 50000)]), rng.randint(1, 768)
    while num * dim > (1 << 22):
        dim = max(1, dim // 2)
    idx_shape = fit([rng.randint(1, 16), rng.randint(1, 512)], CAP // dim, keep=1)
    idx = torch.randint(0, num, idx_shape, dtype=(idt := rng.choice([torch.int64, torch.int32])))
    dtype = dtype_of(rng)
    if rng.random() < 0.6:
        pad, sgf = rng.choice([None, None, 0, num - 1]), rng.random() < 0.2
        model: nn.Module = nn.Embedding(num, dim, padding_idx=pad, scale_grad_by_freq=sgf)
        desc, inputs = f"Embedding({num}, {dim}, padding_idx={pad}, scale_grad_by_freq={sgf})", (idx,)
    else:
        mode, pad = rng.choice(["sum", "mean", "max"]), rng.choice([None, 0])
        model = nn.EmbeddingBag(num, dim, mode=mode, padding_idx=pad)
        desc, inputs = f"EmbeddingBag({num}, {dim}, mode={mode}, padding_idx={pad})", (idx,)
        if rng.random() < 0.5:
            flat = idx.reshape(-1)
            cuts = rng.sample(range(flat.numel()), min(flat.numel(), rng.randint(0, 32)))
            offsets = torch.tensor(sorted({0, *cuts}), dtype=idt)
            inputs, desc = (flat, offsets), desc + f" offsets(n={offsets.numel()})"
            if mode == "sum" and rng.random() < 0.5:
                w = torch.rand(flat.numel(), dtype=dtype, requires_grad=rng.random() < 0.5)
                inputs, desc = (flat, offsets, w), desc + f" per_sample_weights rg={w.requires_grad}"
    return finish(rng, "embedding", f"{desc} idx{tuple(idx_shape)} {str(idt)[6:]} {str(dtype)[6:]}", model, inputs, dtype)


def rnn(rng: random.Random) -> Case:
    cls = rng.choice([nn.RNN, nn.GRU, nn.LSTM])
    inp, hid, layers = rng.randint(1, 128), rng.randint(1, 256), rng.randint(1, 2)
    bi, bf = rng.random() < 0.4, rng.random() < 0.5
    drop = rng.choice([0.0, 0.3]) if layers > 1 else 0.0
    kw = {"nonlinearity": rng.choice(["tanh", "relu"])} if cls is nn.RNN else {}
    if cls is nn.LSTM and rng.random() < 0.2 and hid > 1:
        kw["proj_size"] = rng.randint(1, hid - 1)
    model = cls(inp, hid, layers, bias=rng.random() < 0.8, batch_first=bf, dropout=drop, bidirectional=bi, **kw)
    batch, seq, dtype = rng.randint(1, 8), rng.randint(1, 64), dtype_of(rng)
    x, xd = tensor(rng, [batch, seq, inp] if bf else [seq, batch, inp], dtype, rng.random() < 0.5, ("contig", "perm"))
    desc = f"{cls.__name__}({inp}, {hid}, layers={layers}, bidir={bi}, batch_first={bf}, dropout={drop}, {kw}) {xd}"
    return finish(rng, "rnn", desc, model, (x,), dtype)


def attention(rng: random.Random) -> Case:
    dtype = dtype_of(rng)
    b, h, lq = rng.randint(1, 8), rng.randint(1, 16), rng.randint(1, 256)
    lk = lq if rng.random() < 0.6 else rng.randint(1, 256)
    if rng.random() < 0.3:  # nn.MultiheadAttention
        e = h * rng.randint(1, 32)
        kdim = None if rng.random() < 0.7 else rng.randint(1, 96)
        bf, nw = rng.random() < 0.5, rng.random() < 0.5
        drop, rg = rng.choice([0.0, 0.0, 0.1]), rng.random() < 0.5
        mha = nn.MultiheadAttention(e, h, dropout=drop, bias=rng.random() < 0.8, add_bias_kv=rng.random() < 0.2,
                                    kdim=kdim, vdim=kdim, batch_first=bf)
        causal = rng.random() < 0.3 and kdim is None
        lk = lq if causal else lk
        q, qd = tensor(rng, [b, lq, e] if bf else [lq, b, e], dtype, rg)
        kv, kvd = (q, "self") if kdim is None and lk == lq and rng.random() < 0.6 else \
            tensor(rng, [b, lk, kdim or e] if bf else [lk, b, kdim or e], dtype, rg)
        mask = torch.triu(torch.ones(lq, lk, dtype=torch.bool), 1) if causal else None
        model = Fn(lambda m, q, kv: m.mha(q, kv, kv, need_weights=nw, attn_mask=mask, is_causal=causal))
        model.mha = mha  # a submodule
        desc = (f"MultiheadAttention(e={e}, h={h}, kdim={kdim}, dropout={drop}, bias_kv={mha.bias_k is not None}, "
                f"batch_first={bf}, need_weights={nw}, causal={causal}) q:{qd} kv:{kvd}")
        return finish(rng, "attention", desc, model, (q, kv), dtype)
    e = rng.choice([8, 16, 32, 64, 80, 128, rng.randint(1, 96)])
    ev = e if rng.random() < 0.8 else rng.randint(1, 96)
    while b * h * lq * lk > CAP:
        b, h = (b // 2, h) if b > 1 else (b, max(1, h // 2))
        if b == 1 and h == 1:
            lq, lk = max(1, lq // 2), max(1, lk // 2)
    causal, masked = rng.random() < 0.3, rng.choice([None, None, "bool", "float"])
    causal, drop = causal and not masked, rng.choice([0.0, 0.0, 0.1, 0.5])
    layout, rgs = ("contig", "perm") if rng.random() < 0.5 else ("contig",), [rng.random() < 0.6 for _ in range(3)]
    q, qd = tensor(rng, [b, h, lq, e], dtype, rgs[0], layout)
    k, _ = tensor(rng, [b, h, lk, e], dtype, rgs[1], layout)
    v, _ = tensor(rng, [b, h, lk, ev], dtype, rgs[2], layout)
    mshape = [rng.choice([1, b]), rng.choice([1, h]), lq, lk]
    inputs = (q, k, v) + ({"bool": (torch.rand(mshape) > 0.2,), "float": (torch.randn(mshape, dtype=dtype),)}.get(masked) or ())
    scale = rng.choice([None, None, 0.1])
    model = Fn(lambda m, q, k, v, mask=None: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=drop,
                                                                            is_causal=causal, scale=scale))
    desc = (f"F.scaled_dot_product_attention(q{(b, h, lq, e)}, k{(b, h, lk, e)}, v{(b, h, lk, ev)}, mask={masked}"
            f"{mshape if masked else ''}, causal={causal}, dropout_p={drop}, scale={scale}) q:{qd} rg(qkv)={rgs}")
    return finish(rng, "attention", desc, model, inputs, dtype)


def reduction(rng: random.Random) -> Case:
    op = rng.choice(["sum", "mean", "amax", "amin", "var", "std", "norm", "logsumexp", "softmax", "log_softmax",
                     "cumsum", "prod", "max"])
    nd, keep, p = rng.randint(1, 4), rng.random() < 0.5, rng.choice([2, 1, float("inf"), 3])
    shape = fit([rng.randint(1, {1: 100000, 2: 2048, 3: 256, 4: 64}[nd]) for _ in range(nd)], keep=0)
    if op in ("softmax", "log_softmax", "cumsum", "prod", "max"):
        dims: int | tuple | None = rng.randrange(nd)
    else:
        dims = rng.choice([None, tuple(sorted(rng.sample(range(nd), rng.randint(1, nd))))])
        dims = tuple(range(nd)) if dims is None and op in ("amax", "amin", "logsumexp") else dims
    full = dims is None and op in ("sum", "mean") and rng.random() < 0.5

    def fn(m: nn.Module, x: torch.Tensor):
        if full:
            return getattr(torch, op)(x)
        if op in ("softmax", "log_softmax", "cumsum"):
            return getattr(torch, op)(x, dims)
        if op == "norm":
            return torch.linalg.vector_norm(x, p, dims, keep)
        return getattr(torch, op)(x, dims, keepdim=keep)

    keepd = "" if op in ("softmax", "log_softmax", "cumsum") else f", keepdim={keep}"
    desc = f"torch.{op}() full" if full else f"torch.{op}(dim={dims}{keepd}{f', p={p}' if op == 'norm' else ''})"
    x, xd = tensor(rng, shape, dtype := dtype_of(rng), rng.random() < 0.85, ("contig", "contig", "perm", "slice", "cl"))
    return finish(rng, "reduction", f"{desc} {xd}", Fn(fn), (x,), dtype)


def matmul(rng: random.Random) -> Case:
    kind = rng.choice(["linear", "linear", "mm", "bmm", "matmul", "einsum"])
    m, k, n = (rng.choice([rng.randint(1, 16), rng.randint(17, 512), rng.randint(513, 2048)]) for _ in range(3))
    while m * k > CAP or k * n > CAP or m * n > CAP:
        m, k, n = max(1, m // 2), max(1, k // 2), max(1, n // 2)
    dtype, rg = dtype_of(rng), rng.random() < 0.6
    lay = ("contig", "perm") if rng.random() < 0.5 else ("contig", "slice")
    if kind == "linear":
        lead = fit([rng.randint(1, 16) for _ in range(rng.randint(0, 2))] + [m], CAP // max(k, n), keep=0)
        bias, (x, xd) = rng.random() < 0.7, tensor(rng, lead + [k], dtype, rg, lay)
        return finish(rng, "matmul", f"Linear({k}, {n}, bias={bias}) {xd}", nn.Linear(k, n, bias=bias), (x,), dtype)
    batch = fit([rng.randint(1, 8) for _ in range(2 if kind in ("matmul", "einsum") else 1)], CAP // max(m * k, k * n, m * n), keep=0)
    batch = [] if kind == "mm" else batch
    a_shape = batch + [m, k]
    b_shape = (batch if kind == "bmm" else [rng.choice([1, x]) for x in batch]) + [k, n]
    if kind == "matmul" and rng.random() < 0.3:
        b_shape = b_shape[-2:] if rng.random() < 0.5 else [k]
    a, ad = tensor(rng, a_shape, dtype, rg, lay)
    op = {"mm": torch.mm, "bmm": torch.bmm, "matmul": torch.matmul,
          "einsum": lambda a, b: torch.einsum("...mk,...kn->...mn", a, b)}[kind]
    if rng.random() < 0.5:  # the second operand is a weight, maybe stored transposed
        t = rng.random() < 0.5 and len(b_shape) > 1
        w = nn.Parameter(torch.randn(b_shape[:-2] + b_shape[-2:][::-1] if t else b_shape))
        fn = (lambda mod, a: op(a, mod.params["w"].transpose(-1, -2))) if t else (lambda mod, a: op(a, mod.params["w"]))
        model, inputs, bd = Fn(fn, w=w), (a,), f"weight{tuple(b_shape)} transposed={t}"
    else:
        b, bd = tensor(rng, b_shape, dtype, rng.random() < 0.6, lay)
        model, inputs = Fn(lambda mod, a, b: op(a, b)), (a, b)
    return finish(rng, "matmul", f"{kind}(a:{ad}, b:{bd})", model, inputs, dtype)


ACTS = {"relu": F.relu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu,
        "sigmoid": torch.sigmoid, "tanh": torch.tanh, "hardswish": F.hardswish,
        "leaky_relu": lambda x: F.leaky_relu(x, 0.1), "mul": None, "add": None}
INPLACE = {"relu": F.relu_, "silu": lambda x: F.silu(x, inplace=True), "sigmoid": torch.sigmoid_, "tanh": torch.tanh_,
           "hardswish": lambda x: F.hardswish(x, inplace=True), "leaky_relu": lambda x: F.leaky_relu_(x, 0.1),
           "gelu": None, "gelu_tanh": None}
SAVES_OUT = {"relu", "sigmoid", "tanh", "leaky_relu"}  # backward uses the output (in place: the result)


def pointwise(rng: random.Random) -> Case:
    nd = rng.randint(1, 4)
    shape = fit([rng.randint(1, {1: 200000, 2: 2048, 3: 256, 4: 64}[nd]) for _ in range(nd)], keep=0)
    x, xd = tensor(rng, shape, dtype := dtype_of(rng), rng.random() < 0.7, ("contig", "contig", "perm", "slice", "cl"))
    ops = [rng.choice(list(ACTS)) for _ in range(rng.randint(1, 3))]
    other = [rng.choice([1, s]) for s in shape][rng.randint(0, nd - 1):]
    pre = rng.choice(["none", "scale", "add1"])
    inplace = pre != "none" and rng.random() < 0.6

    def fn(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        w = m.params["w"]
        y = x * w if pre == "scale" else x + 1 if pre == "add1" else x
        fresh = pre != "none"  # y may be overwritten: autograd did not save it
        for op in ops:
            if op == "mul":
                y, fresh = y * w, True
            elif op == "add":
                y, fresh = (y.add_(w) if inplace and fresh else y + w), True
            elif inplace and fresh and INPLACE.get(op):
                y, fresh = INPLACE[op](y), op not in SAVES_OUT
            else:
                y, fresh = ACTS[op](y), op not in SAVES_OUT
        return y

    desc = f"pre={pre} then {ops} (other operand w{tuple(other)}), inplace={inplace} {xd}"
    return finish(rng, "pointwise", desc, Fn(fn, w=nn.Parameter(torch.randn(other))), (x,), dtype)


def residual(*layers: nn.Module, skip: bool = True) -> nn.Module:
    model = Fn((lambda m, x: x + m.body(x)) if skip else (lambda m, x: m.body(x)))
    model.body = nn.Sequential(*layers)
    return model


def block(rng: random.Random) -> Case:
    kind, dtype, b = rng.choice(["convbn", "mlp", "transformer", "dwsep"]), dtype_of(rng), rng.randint(1, 8)
    if kind in ("convbn", "dwsep"):
        c, c2 = channels(rng), channels(rng)
        shape = fit([b, c, rng.randint(4, 64), rng.randint(4, 64)], CAP // 2)
        if kind == "convbn":
            k = rng.choice([1, 3, 5])
            model: nn.Module = nn.Sequential(nn.Conv2d(c, c2, k, stride=rng.choice([1, 2]), padding=k // 2, bias=False),
                                             nn.BatchNorm2d(c2), nn.ReLU(inplace=rng.random() < 0.7))
            desc = f"Conv2d({c},{c2},k={k},s={model[0].stride[0]})-BN-ReLU(inplace={model[2].inplace})"
        else:
            mult, skip = rng.choice([1, 2, 4]), rng.random() < 0.5
            model = residual(nn.Conv2d(c, c * mult, 3, padding=1, groups=c, bias=False), nn.BatchNorm2d(c * mult),
                             nn.ReLU6(inplace=True), nn.Conv2d(c * mult, c, 1, bias=False), nn.BatchNorm2d(c), skip=skip)
            desc = f"dwsep(c={c}, mult={mult}, residual={skip})"
        x, xd = tensor(rng, shape, dtype, rng.random() < 0.3, ("contig", "cl"))
        if rng.random() < 0.3:
            model = model.to(memory_format=torch.channels_last)
            desc += " weights channels_last"
    else:
        h = rng.randint(1, 12)
        e, act = h * rng.randint(2, 64), rng.choice(["gelu", "gelu_tanh", "relu", "silu"])
        lead = fit([b, rng.randint(1, 256)], CAP // (4 * e), keep=0)
        a = nn.GELU(approximate="tanh") if act == "gelu_tanh" else {"gelu": nn.GELU(), "relu": nn.ReLU(), "silu": nn.SiLU()}[act]
        if kind == "mlp":
            hid = rng.randint(1, 4 * e)
            model = residual(nn.Linear(e, hid), a, nn.Linear(hid, e))
            desc = f"x + Linear({e},{hid})-{act}-Linear"
        else:
            norm_first = rng.random() < 0.7
            model = nn.TransformerEncoderLayer(e, h, rng.randint(e, 4 * e), dropout=rng.choice([0.0, 0.1]), activation=a,
                                               batch_first=True, norm_first=norm_first)
            desc = f"TransformerEncoderLayer(e={e}, h={h}, ff={model.linear1.out_features}, act={act}, norm_first={norm_first})"
        x, xd = tensor(rng, lead + [e], dtype, rng.random() < 0.3, ("contig", "perm"))
    return finish(rng, "block", f"{kind}: {desc} {xd}", model, (x,), dtype)


class Autocast(nn.Module):
    """A float32 body run under ``torch.autocast`` entered in its forward (the usual mixed-precision
    training code): ops on autocast's lists run in the low precision, the rest in float32, and
    kernels mix them (BatchNorm on a bfloat16 input keeps float32 statistics)."""

    def __init__(self, body: nn.Module, dtype: torch.dtype, skip: bool) -> None:
        super().__init__()
        self.body, self.dtype, self.skip = body, dtype, skip

    def forward(self, x):
        with torch.autocast("cpu", dtype=self.dtype):
            y = self.body(x)
        return x + y if self.skip else y


def autocast(rng: random.Random) -> Case:
    """Mixed-precision chains: (conv | linear) -> norm -> activation -> (conv | linear), in float32
    under a bfloat16 or float16 autocast."""
    kind, low = rng.choice(["conv", "linear"]), rng.choice([torch.bfloat16, torch.bfloat16, torch.float16])
    act_name = rng.choice(["relu", "relu_", "gelu", "silu", "none"])
    act = {"relu": nn.ReLU(), "relu_": nn.ReLU(inplace=True), "gelu": nn.GELU(), "silu": nn.SiLU(),
           "none": nn.Identity()}[act_name]
    b, c = rng.randint(1, 8), channels(rng)
    if kind == "conv":
        norm_name = rng.choice(["bn", "bn", "gn", "none"])
        k = rng.choice([1, 3])
        shape = fit([b, c, rng.randint(4, 48), rng.randint(4, 48)], CAP // 4)
        norm = {"bn": nn.BatchNorm2d(c), "gn": nn.GroupNorm(math.gcd(c, rng.choice([1, 2, 4, 8])), c),
                "none": nn.Identity()}[norm_name]
        body = nn.Sequential(nn.Conv2d(c, c, k, padding=k // 2, bias=rng.random() < 0.5), norm, act,
                             nn.Conv2d(c, c, k, padding=k // 2, bias=False))
        x, xd = tensor(rng, shape, torch.float32, rng.random() < 0.3, ("contig", "cl"))
    else:
        norm_name = rng.choice(["ln", "ln", "bn1d", "none"])
        shape = fit([b, rng.randint(1, 128), c], CAP // 4, keep=0)
        norm = {"ln": nn.LayerNorm(c), "bn1d": Fn(lambda m, t: m.bn(t.transpose(1, 2)).transpose(1, 2)),
                "none": nn.Identity()}[norm_name]
        if norm_name == "bn1d":
            norm.bn = nn.BatchNorm1d(c)
        body = nn.Sequential(nn.Linear(c, c), norm, act, nn.Linear(c, c))
        x, xd = tensor(rng, shape, torch.float32, rng.random() < 0.3, ("contig", "perm"))
    skip = rng.random() < 0.4
    desc = f"autocast({str(low)[6:]}): {kind}-{norm_name}-{act_name}-{kind}, residual={skip} {xd}"
    return finish(rng, "autocast", desc, Autocast(body, low, skip), (x,), torch.float32)


BUILDERS: dict[str, Callable[[random.Random], Case]] = {
    "conv": conv, "pool": pool, "interp": interp, "norm": norm, "embedding": embedding, "rnn": rnn,
    "attention": attention, "reduction": reduction, "matmul": matmul, "pointwise": pointwise, "block": block,
    "autocast": autocast}
WEIGHTS = {"conv": 3}  # every other family 1
# Families drawn from a seed stream of their own, so the seeds of the families before them keep
# their configurations (results files from earlier runs stay comparable): family -> share of seeds.
SIDE_FAMILIES = {"autocast": 1 / 14}

"""Independent convolution scan behind cpu_conv.py's reduced-grouped envelope and the gemm bound check:
random oneDNN convolutions (not the opfuzz generator), each op measured alone (calibrate.measure_kernel,
2 threads): forward kernel memory and backward scratch for three gradient masks, one JSON line each.

    python benchmarks/conv_scan.py SEED OUT.jsonl N     (used: seeds 12345 and 777, N 80)
"""
import json, math, random, sys
import torch
from remat.profiler.calibrate import measure_kernel
torch.set_num_threads(2)
a = torch.ops.aten
rng = random.Random(int(sys.argv[1]) if len(sys.argv) > 1 else 12345)
out = open(sys.argv[2] if len(sys.argv) > 2 else '/tmp/scan/conv.jsonl', 'a')
for i in range(int(sys.argv[3]) if len(sys.argv) > 3 else 60):
    d = rng.choice([1, 2, 2, 3]); tr = rng.random() < 0.3
    cin = rng.choice([1, 3, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160])
    kind = rng.choice(['dense', 'dw', 'grp'])
    if kind == 'dw': g = cin; cout = cin * rng.choice([1, 2])
    elif kind == 'grp' and cin % 2 == 0 and cin > 2: g = rng.choice([x for x in (2, 4, 8) if cin % x == 0]); cout = g * rng.randint(1, 16)
    else: g = 1; cout = rng.choice([4, 8, 16, 32, 64, 100, 128])
    k = [rng.choice([1, 2, 3, 5]) for _ in range(d)]
    dil = rng.choice([1, 1, 2, 3, 4]); st = rng.choice([1, 1, 2, 3])
    N = rng.randint(1, 6)
    sp = [rng.randint(min(8, {1: 300, 2: 48, 3: 14}[d]), {1: 300, 2: 48, 3: 14}[d]) for _ in range(d)]
    pad = [dil * (kk - 1) // 2 for kk in k]
    dt = rng.choice([torch.float32, torch.float32, torch.bfloat16])
    cl = d > 1 and rng.random() < 0.3
    x = torch.randn([N, cin] + sp, dtype=dt)
    if cl: x = x.contiguous(memory_format=torch.channels_last if d == 2 else torch.channels_last_3d)
    w = torch.randn(([cin, cout // g] if tr else [cout, cin // g]) + k, dtype=dt)
    args = (x, w, None, [st] * d, pad, [dil] * d, tr, [0] * d, g)
    try:
        y = a.convolution(*args)
    except Exception as e:
        continue
    if y.numel() * 4 > 64e6: continue
    rec = dict(xs=list(x.shape), ws=list(w.shape), ys=list(y.shape), st=st, dil=dil, pad=pad, tr=tr, g=g, dt=str(dt)[6:], cl=cl)
    f = measure_kernel(a.convolution.default, args, {}, 2)
    rec['fwd'] = f[0] + max(0, f[1] - y.numel() * y.element_size()) if f else None
    gy = torch.ones(1, dtype=dt).expand(y.shape)
    for name, mask in (('b111', [True, True, False]), ('b011', [False, True, False]), ('b100', [True, False, False])):
        b = measure_kernel(a.convolution_backward.default, (gy, x, w, None, [st] * d, pad, [dil] * d, tr, [0] * d, g, mask), {}, 2)
        rec[name] = b[0] if b else None
    out.write(json.dumps(rec) + '\n'); out.flush()

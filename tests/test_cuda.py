"""Planning a GPU step (device="cuda") on a machine without one; the real-GPU checks skip here."""
import re
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import remat
from remat.cli import main
from remat.fake import FakeSession
from remat.profiler.dispatch import Simulation, Target
from remat.profiler.rules import granularity, round_up
from remat.profiler.rules.cuda import cublas_workspace_bytes
from remat.profiler.standin import cuda_sdpa_backend
from remat.step import loss_of
from remat.testing import assert_same_step

CUDA = torch.device("cuda", 0)
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


class Odd(nn.Module):
    """Tensors of sizes that are not multiples of 512 bytes (7 x 13 floats, ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(13, 7)
        self.b = nn.Linear(7, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)) * 1.5)


class Attention(nn.Module):
    """A ViT-like stack: pre-norm blocks of multi-head self-attention over 197 tokens."""

    def __init__(self, dim: int = 64, heads: int = 4, depth: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(depth))
        self.proj = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))
        self.norm = nn.ModuleList(nn.LayerNorm(dim) for _ in range(depth))

    def forward(self, x):
        b, n, d = x.shape
        for qkv, proj, norm in zip(self.qkv, self.proj, self.norm):
            q, k, v = qkv(norm(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            x = x + proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d))
        return x


def _allocations(model, args, target):
    """Every size the simulated allocator counted during one step, and its peak."""
    sim = Simulation(model, args, target=target)
    sizes = []
    allocate = sim.tracker.allocate

    def spy(storages):
        added = allocate(storages)
        sizes.append(added)
        return added

    sim.tracker.allocate = spy
    with sim.running():
        loss_of(model(*sim.args)).backward()
    return [s for s in sizes if s], sim.tracker.peak


def test_granularity_and_rounding_come_from_the_rules():
    assert granularity("cuda") == 512 and granularity("cpu") == 1
    assert [round_up(n, "cuda") for n in (0, 1, 511, 512, 513)] == [0, 512, 512, 512, 1024]
    assert round_up(513, "cpu") == 513


def test_cuda_allocations_are_multiples_of_512_and_cpu_ones_are_not():
    model, x = Odd(), torch.randn(5, 13)
    cuda_sizes, cuda_peak = _allocations(model, (x,), Target(CUDA, 1))
    cpu_sizes, cpu_peak = _allocations(model, (x,), Target(torch.device("cpu"), 1))
    assert cuda_sizes and all(s % 512 == 0 for s in cuda_sizes)
    assert any(s % 512 for s in cpu_sizes)  # the same step unrounded: the test can tell them apart
    # every storage of this step is under 512 bytes, so each costs exactly 512 on the GPU
    assert len(cuda_sizes) == len(cpu_sizes) and cuda_peak >= cpu_peak


def test_cuda_peak_counts_the_cublas_workspace_as_resident():
    model, x = Odd(), torch.randn(5, 13)
    cpu, cuda = remat.profile(model, x, calibrate=False), remat.profile(model, x, device="cuda")
    assert cuda.workspace_bytes == cublas_workspace_bytes() == 33 * 2**20
    # every resident storage (parameters, input) in whole 512-byte blocks, as the GPU holds it
    blocks = sum(round_up(t.untyped_storage().nbytes(), "cuda") for t in (*model.parameters(), x))
    assert cpu.resident_bytes < blocks and cuda.resident_bytes == blocks + cuda.workspace_bytes
    assert cuda.peak_bytes >= cpu.peak_bytes + cuda.workspace_bytes


class Head(nn.Module):
    """vit_b_16's classifier sizes: a 1000-way bias is 4000 bytes, 416 bytes past a block boundary."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(6)])
        self.head = nn.Linear(64, 1000)

    def forward(self, x):
        return self.head(self.body(x))


def test_every_cuda_prediction_is_whole_512_byte_blocks():
    """The GPU's allocator holds whole blocks for parameters, gradients and inputs too: a CUDA
    peak, resident or gradient total off a block boundary counted something unrounded (vit_b_16
    at batch 16 on meta predicted a peak 416 bytes off: its head's bias)."""
    with torch.device("meta"):
        model = Head()
    x = torch.empty(32, 64, device="meta")
    prof = remat.profile(model, (x,), device="cuda")
    for name in ("peak_bytes", "resident_bytes", "param_bytes", "grad_bytes", "input_bytes"):
        assert getattr(prof, name) % 512 == 0, (name, getattr(prof, name))
    gm = remat.checkpoint(Head(), (torch.randn(512, 64),), budget=0.7, device="cuda")
    plan = gm.remat_plan
    assert plan.regions and plan.predicted_peak_bytes % 512 == 0
    assert plan.info["fixed_bytes"] % 512 == 0 and plan.info["unconstrained_peak_bytes"] % 512 == 0


def test_workspace_size_follows_the_environment():
    assert cublas_workspace_bytes({"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}) == 32 * 2**20 + 2**20
    assert cublas_workspace_bytes({"CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == 2 * 16 * 1024 * 8
    assert cublas_workspace_bytes({"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "1"}) == 32 * 2**20


def test_fake_session_moves_tensors_to_the_target_without_copying_and_keeps_aliasing():
    base = torch.randn(4, 6, requires_grad=True)
    view = base[1:, ::2]
    session = FakeSession.for_call(None, (base, view), device=CUDA)
    fb, fv = session.tree((base, view))
    assert fb.device == CUDA and fv.device == CUDA
    assert fv.stride() == view.stride() and fv.storage_offset() == view.storage_offset()
    assert fb.untyped_storage() is fv.untyped_storage() or id(fb.untyped_storage()) == id(fv.untyped_storage())
    assert fb.requires_grad and isinstance(fb, torch._subclasses.FakeTensor)


def test_attention_is_the_fused_kernels_not_the_attention_matrix():
    b, n, heads = 2, 197, 4
    model, x = Attention(heads=heads), torch.randn(b, n, 64)
    q = torch.empty(b, heads, n, 16)
    assert cuda_sdpa_backend(q, q, q) == "efficient"  # fp32
    assert cuda_sdpa_backend(q.half(), q.half(), q.half()) == "flash"
    cpu = remat.profile(model, x, calibrate=False)
    cuda = remat.profile(model, x, device="cuda")
    with sdpa_kernel(SDPBackend.MATH):
        math = remat.profile(model, x, device="cuda")  # what fake CUDA dispatch without a GPU would pick
    matrix = b * heads * n * n * 4
    # the math path saves each block's attention matrix; the fused kernels a GPU runs keep their
    # output and a logsumexp instead (b * heads * n * 16 and b * heads * 224 floats)
    assert math.saved_bytes - cuda.saved_bytes >= 2 * (matrix - b * heads * n * 16 * 4 - b * heads * 224 * 4)
    # memory-efficient attention's logsumexp is padded to 32 rows (224 for 197) where the CPU's
    # flash kernel keeps 197, and every CUDA allocation is rounded up: the GPU saves a little more
    assert 0 < cuda.saved_bytes - cpu.saved_bytes < matrix // 4
    # and the step's peak follows: the attention matrices the math path would keep are not there
    assert math.peak_bytes - cuda.peak_bytes >= matrix


@pytest.mark.slow  # (2.2 s) the fast CUDA checks are the rules, the fake session and the fused attention above
def test_resnet18_cuda_plan_fits_and_its_module_runs_anywhere():
    torchvision = pytest.importorskip("torchvision")
    model = torchvision.models.resnet18()
    x = torch.randn(8, 3, 128, 128)
    # rotor's floor for this step is 0.67 of the span on CUDA (0.62 on the CPU at 224 px): plan above it
    gm = remat.checkpoint(model, x, budget=0.75, device="cuda")
    plan = gm.remat_plan
    assert plan.regions and plan.predicted_peak_bytes <= plan.budget_bytes
    assert plan.info["device"] == "cuda" and plan.info["scratch"] == "rules"
    assert plan.info["times"].startswith("nominal")
    assert "cuda" not in gm.code and "cpu" not in gm.code and "device" not in gm.code
    assert "torch.utils.checkpoint.checkpoint(" in gm.code
    assert_same_step(model, lambda m: remat.apply_plan(m, x, plan), (x,))


def test_cli_plans_vit_b_16_for_a_gpu(capsys):
    pytest.importorskip("torchvision")
    start = time.perf_counter()
    assert main(["plan", "torchvision:vit_b_16", "--batch", "64", "--budget", "50%", "--device", "cuda"]) == 0
    elapsed = time.perf_counter() - start
    out = capsys.readouterr().out
    assert "(fits)" in out and "planned for     cuda" in out and "cuda rules" in out
    assert elapsed < 300


test_cli_plans_vit_b_16_for_a_gpu = pytest.mark.slow(test_cli_plans_vit_b_16_for_a_gpu)


def test_cli_refuses_to_measure_a_gpu_plan_on_the_cpu(capsys):
    assert main(["plan", "mlp", "--batch", "2", "--device", "cuda", "--measure"]) == 2
    assert "benchmarks/cuda.py" in capsys.readouterr().err


def test_bad_device_is_refused():
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        remat.profile(Odd(), torch.randn(2, 13), device="xpu")


# --- on a GPU (skipped here) -----------------------------------------------------------------------
@needs_gpu
def test_gpu_step_is_within_budget_and_prediction():
    torchvision = pytest.importorskip("torchvision")
    model = torchvision.models.resnet18()
    x = torch.randn(16, 3, 224, 224)
    gm = remat.checkpoint(model, x, budget=0.75, device="cuda")
    plan = gm.remat_plan
    gm.cuda()
    measured = remat.measure_peak(gm, x.cuda())
    assert measured <= plan.budget_bytes
    assert abs(plan.predicted_peak_bytes - measured) <= 0.01 * measured, (plan.predicted_peak_bytes, measured)


@needs_gpu
def test_gpu_attention_prediction_within_one_percent():
    model, x = Attention(dim=256, heads=4, depth=4), torch.randn(32, 197, 256)
    predicted = remat.profile(model, x, device="cuda").peak_bytes
    measured = remat.measure_peak(model.cuda(), x.cuda())
    assert abs(predicted - measured) <= 0.01 * measured, (predicted, measured)


def test_cuda_benchmark_without_a_gpu_says_so_and_exits_0(capsys, monkeypatch):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "cuda.py"
    spec = importlib.util.spec_from_file_location("bench_cuda", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main([]) == 0
    assert "none is available" in capsys.readouterr().out

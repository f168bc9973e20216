"""The checkpointed module under DDP and FSDP2 (2 CPU processes, gloo) and torch.compile."""
import copy
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import remat
from remat.zoo import ResidualMLP


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, mode: str, queue) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        base = ResidualMLP(width=32, depth=4, p=0.0)
        x = torch.randn(8, 8, 32)[rank * 4:(rank + 1) * 4]
        gm = remat.checkpoint(copy.deepcopy(base), (x,), solver="every-stage")
        grads = []
        for module in (base, gm):
            if mode == "ddp":
                wrapped = torch.nn.parallel.DistributedDataParallel(module)
            else:
                from torch.distributed.device_mesh import init_device_mesh
                from torch.distributed.fsdp import fully_shard

                wrapped = fully_shard(module, mesh=init_device_mesh("cpu", (world,)))
            wrapped(x).sum().backward()
            grads.append({k: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
                          for k, p in module.named_parameters()})
        same = grads[0].keys() == grads[1].keys() and all(
            torch.allclose(grads[0][k], grads[1][k], atol=1e-6, rtol=1e-5) for k in grads[0])
        queue.put((rank, same, len(grads[0])))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_gradients_equal_the_uncheckpointed_model_under_the_same_wrapper(mode):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, mode, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(60)
    assert sorted(r[0] for r in results) == [0, 1]
    assert all(r[1] and r[2] > 0 for r in results), results


def test_torch_compile_gives_the_same_loss_and_gradients():
    torch.manual_seed(0)
    gm = remat.checkpoint(ResidualMLP(width=32, depth=3, p=0.0), (torch.randn(2, 8, 32),), solver="every-stage")
    x = torch.randn(2, 8, 32)
    ref = gm(x).sum()
    ref.backward()
    grads = {k: p.grad.clone() for k, p in gm.named_parameters()}
    gm.zero_grad(set_to_none=True)
    loss = torch.compile(gm)(x).sum()
    loss.backward()
    torch.testing.assert_close(loss, ref)
    for k, p in gm.named_parameters():
        torch.testing.assert_close(p.grad, grads[k], atol=1e-5, rtol=1e-4)

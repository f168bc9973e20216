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


def _run_on_two_processes(target, *args) -> list:
    """Spawn ``target(rank, 2, port, *args, queue)`` on ranks 0 and 1; each puts one result tuple
    starting with its rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=target, args=(r, 2, port, *args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(60)
    assert sorted(r[0] for r in results) == [0, 1]
    return results


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


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_gradients_equal_the_uncheckpointed_model_under_the_same_wrapper(mode):
    results = _run_on_two_processes(_worker, mode)
    assert all(r[1] and r[2] > 0 for r in results), results


def _sharded_worker(rank: int, world: int, port: int, queue) -> None:
    """Plan one process of FSDP2 training, shard with remat.fully_shard, train one step."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        base = ResidualMLP(width=256, depth=12, p=0.0)
        x = torch.randn(2 * world, 32, 256)[rank * 2:(rank + 1) * 2].repeat(4, 1, 1)
        gm = remat.checkpoint(base, (x,), budget=0.5, world_size=world, sharding="fsdp")
        # the traced model without checkpoints (its own copy: fully_shard converts modules in place)
        plain = remat.checkpoint(copy.deepcopy(base), (x,), solver="none")
        measured = remat.measure_peak(remat.fully_shard(gm, mesh), (x,))
        grads = []
        for module in (remat.fully_shard(plain, mesh), gm):
            module(x).sum().backward()
            grads.append({k: p.grad.full_tensor().clone() for k, p in module.named_parameters()})
        same = grads[0].keys() == grads[1].keys() and all(
            torch.allclose(grads[0][k], grads[1][k], atol=1e-6, rtol=1e-5) for k in grads[0])
        queue.put((rank, same, measured, gm.remat_plan))
    except Exception as e:  # report it instead of leaving the test waiting on the queue
        queue.put((rank, False, repr(e), None))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_plan_keeps_each_process_within_its_budget():
    results = _run_on_two_processes(_sharded_worker)
    # what one unsharded process would need without checkpointing
    unsharded = remat.checkpoint(ResidualMLP(width=256, depth=12, p=0.0), (torch.randn(8, 32, 256),),
                                 solver="none").remat_plan.predicted_peak_bytes
    for rank, same, measured, plan in results:
        assert plan is not None, f"rank {rank} failed: {measured}"
        assert same, f"rank {rank}: gradients differ from the un-checkpointed model under FSDP2"
        assert plan.regions, "budget 0.5 should need checkpointing"
        assert plan.info["world_size"] == 2
        # torch's selective checkpoint refuses FSDP2's hooks (planner/search.py): plain regions only
        assert all(r.policy == "" for r in plan.regions), plan.regions
        assert measured <= plan.budget_bytes, (rank, measured, plan.budget_bytes)
        assert plan.info["unconstrained_peak_bytes"] < unsharded


def _conv_bn_net() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for i in range(4):
        layers += [torch.nn.Conv2d(3 if i == 0 else 8, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Flatten(), torch.nn.Linear(8 * 16 * 16, 10))


@pytest.mark.slow
def test_torch_compile_gives_the_same_loss_gradients_and_buffers():
    """Regions that freeze BatchNorm during recomputation compile too (dynamo takes no custom
    context_fn; under compile the buffer updates are applied once by AOTAutograd)."""
    x = torch.randn(4, 3, 16, 16)
    gm = remat.checkpoint(_conv_bn_net(), (x,), solver="every-stage")
    assert '**remat.runtime.context(self, freeze="modules")' in gm.code  # the regions freeze BatchNorm when eager
    ref_model = copy.deepcopy(gm)
    ref = ref_model(x).sum()
    ref.backward()
    loss = torch.compile(gm)(x).sum()
    loss.backward()
    torch.testing.assert_close(loss, ref, atol=1e-4, rtol=1e-5)
    grads = dict(ref_model.named_parameters())
    for k, p in gm.named_parameters():
        torch.testing.assert_close(p.grad, grads[k].grad, atol=1e-4, rtol=1e-3)
    buffers = dict(ref_model.named_buffers())
    for k, b in gm.named_buffers():  # updated once, as in the eager step
        torch.testing.assert_close(b, buffers[k], atol=1e-5, rtol=1e-5)


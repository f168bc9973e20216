"""FSDP2 planning checked against real per-process peaks: 2 CPU processes (gloo), one step each.

For each budget: plan one process with ``remat.checkpoint(..., world_size=2, sharding="fsdp")``,
shard with ``remat.fully_shard``, measure the step's peak in every process (docs/design.md's definition,
CPU allocator events; resident = this process's parameter shards, buffers and inputs) and compare
it with the per-process budget.  The unsharded plan of the same per-process batch is the baseline.
Writes benchmarks/results/fsdp.md.

    python benchmarks/fsdp.py [--model resnet50] [--batch 4] [--budgets 0.3,0.5,1.0]
"""
from __future__ import annotations

import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import remat
from remat.units import fmt_bytes
from remat.zoo import build

from common import md_table, write_result

WORLD = 2


def _worker(rank: int, port: int, spec: str, batch: int, budgets: list[float], queue) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (WORLD,))
        for budget in budgets:
            work = build(spec, batch, seed=rank)  # each rank its own data (and weights, as FSDP2 only shards)
            try:
                gm = remat.checkpoint(work.model, work.inputs, budget=budget, world_size=WORLD, sharding="fsdp")
            except remat.InfeasibleBudget as e:
                queue.put((rank, budget, None, str(e)))
                continue
            measured = remat.measure_peak(remat.fully_shard(gm, mesh), work.inputs)
            queue.put((rank, budget, gm.remat_plan, measured))
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="torchvision:resnet50")
    ap.add_argument("--batch", type=int, default=4, help="per process")
    ap.add_argument("--budgets", default="0.3,0.5,1.0")
    args = ap.parse_args(argv)
    budgets = [float(b) for b in args.budgets.split(",")]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_worker, args=(r, port, args.model, args.batch, budgets, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results = sorted((queue.get(timeout=3600) for _ in range(WORLD * len(budgets))), key=lambda r: (r[1], r[0]))
    for p in procs:
        p.join(60)
    work = build(args.model, args.batch)
    unsharded = remat.checkpoint(work.model, work.inputs, solver="none").remat_plan.predicted_peak_bytes
    rows, ok = [], True
    for rank, budget, plan, measured in results:
        if plan is None:
            rows.append([budget, rank, "infeasible", "", "", "", measured[:80]])
            continue
        fits = measured <= plan.budget_bytes
        ok &= fits
        rows.append([budget, rank, fmt_bytes(plan.budget_bytes), fmt_bytes(plan.predicted_peak_bytes),
                     fmt_bytes(measured), f"{(plan.predicted_peak_bytes - measured) / measured * 100:+.1f} %",
                     f"{'yes' if fits else 'NO'}, {len(plan.regions)} regions"])
    table = md_table(["budget", "rank", "per-process budget", "predicted", "measured", "prediction error",
                      "fits"], rows)
    first = next(r for r in results if r[2] is not None)[2]
    text = (f"{args.model}, batch {args.batch} per process, {WORLD} processes (gloo, 1 thread each). "
            f"Unsharded step of one process, predicted: {fmt_bytes(unsharded)}; sharded step without checkpointing, "
            f"predicted: {fmt_bytes(first.info['unconstrained_peak_bytes'])}; fixed (shards, gradient shards, root "
            f"parameters, buffers, inputs and FSDP2's allowance): {fmt_bytes(first.info['fixed_bytes'])}.")
    print(text)
    print(table)
    write_result("fsdp.md", "FSDP2 planning: per-process peaks", [text, table,
                 "The prediction is conservative by design (src/remat/sharding.py): it allows for the two "
                 "largest units' gathered parameters, gradients and collective buffers at once."])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

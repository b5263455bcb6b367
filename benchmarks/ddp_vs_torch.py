#!/usr/bin/python3
"""PyTorch's own DDP (gloo) on the model and data of benchmarks/ddp_vs_torch.cpp.

MLP 784-1024-1024-10 with ReLU, Adam(lr 1e-3), cross-entropy, batch 64 per rank of
random inputs and labels, one intra-op thread per rank. Candidates, alternated per
trial as benchmarks/driver.hpp does, median trial reported:
  - ddp:     DistributedDataParallel with its defaults (bucket_cap_mb=25), gloo;
  - no_comm: the same step on a plain model (no DDP wrapper), no communication. At one
             rank this is plain single-process PyTorch.
Ranks are processes started with torch.multiprocessing.spawn, rendezvous by env://
on 127.0.0.1 and a free port. Prints one JSON line.

  OMP_NUM_THREADS=1 /usr/bin/python3 benchmarks/ddp_vs_torch.py --ranks 2 [--bind]
"""
import argparse
import json
import os
import time

import peer


def mlp(nn):
    return nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def run(rank, args):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    peer.join(rank, args.ranks, bind=args.bind)
    torch.manual_seed(1 + rank)
    batch, pool = 64, 16
    x = torch.randn(pool * batch, 784)
    y = torch.randint(0, 10, (pool * batch,))
    counter = [0]

    def get():
        start = (counter[0] % pool) * batch
        counter[0] += 1
        return x[start:start + batch], y[start:start + batch]

    ddp = DistributedDataParallel(mlp(nn))  # defaults: bucket_cap_mb=25, broadcast_buffers=True
    ddp_optim = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    local = mlp(nn)
    local_optim = torch.optim.Adam(local.parameters(), lr=1e-3)

    def step(model, optim):
        def f():
            inp, target = get()
            optim.zero_grad()
            loss = F.cross_entropy(model(inp), target)
            loss.backward()
            loss.item()  # as paratrain's DataParallel::step reads the loss
            optim.step()
        return f

    candidates = [step(ddp, ddp_optim), step(local, local_optim)]
    for _ in range(args.warmup):
        for f in candidates:
            f()
    per_trial = args.steps // args.trials
    seconds = [[] for _ in candidates]
    for _ in range(args.trials):
        for c, f in enumerate(candidates):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(per_trial):
                f()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # ended by the slowest rank
            seconds[c].append(elapsed.item() / per_trial)
    median = [sorted(s)[len(s) // 2] for s in seconds]
    if rank == 0:
        print(json.dumps({
            "implementation": "pytorch", "version": torch.__version__, "ranks": args.ranks,
            "batch_per_rank": batch, "steps": per_trial * args.trials, "trials": args.trials,
            "threads": torch.get_num_threads(), "bind": args.bind,
            "steps_per_s": round(1 / median[0], 3), "no_comm_steps_per_s": round(1 / median[1], 3)}), flush=True)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=200, help="timed steps per candidate")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--bind", action="store_true", help="pin rank r to core r")
    args = p.parse_args()
    peer.spawn(run, args, args.ranks)


if __name__ == "__main__":
    main()

#!/usr/bin/python3
"""PyTorch's own DDP (gloo) on the model and data of benchmarks/ddp_vs_torch.cpp.

MLP 784-1024-1024-10 with ReLU, Adam(lr 1e-3), cross-entropy, batch 64 per rank of
random inputs and labels, one intra-op thread per rank. Candidates, alternated per
trial as benchmarks/driver.hpp does, median trial reported:
  - ddp:     DistributedDataParallel with its defaults (bucket_cap_mb=25), gloo;
  - no_comm: the same step on a plain model (no DDP wrapper), no communication. At one
             rank this is plain single-process PyTorch.
--hook fp16 or powersgd registers PyTorch's fp16_compress_hook or powerSGD_hook (rank
--powersgd-rank, from the first step, error feedback and warm start on: its defaults) on the
DDP model, for benchmarks/hooks_vs_torch.sh.
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
    if args.hook == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif args.hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=args.powersgd_rank,
                                            start_powerSGD_iter=2)  # its least (1.13 asserts >= 2 with error feedback)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
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
            "steps_per_s": round(1 / median[0], 3), "no_comm_steps_per_s": round(1 / median[1], 3),
            "hook": args.hook, "powersgd_rank": args.powersgd_rank if args.hook == "powersgd" else 0}), flush=True)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=200, help="timed steps per candidate")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--bind", action="store_true", help="pin rank r to core r")
    p.add_argument("--hook", choices=["none", "fp16", "powersgd"], default="none", help="DDP's comm hook")
    p.add_argument("--powersgd-rank", type=int, default=1, help="powerSGD_hook's matrix_approximation_rank")
    args = p.parse_args()
    peer.spawn(run, args, args.ranks)


if __name__ == "__main__":
    main()

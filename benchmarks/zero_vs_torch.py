"""PyTorch's DDP and ZeroRedundancyOptimizer (ZeRO-1) on the model and data of benchmarks/zero.cpp.

MLP of `layers` x Linear(2048, 2048) with ReLU and a Linear(2048, 10) head, Adam(lr 1e-4),
cross-entropy, batch 32 per rank of random inputs and labels, one intra-op thread per
rank, gloo. --mode ddp: DistributedDataParallel with its defaults; --mode zero1: the
same DDP with torch.distributed.optim.ZeroRedundancyOptimizer(Adam) (FSDP does not
import on Debian 12's PyTorch 1.13). Ranks are processes started with
torch.multiprocessing.spawn, pinned to one core each as mpirun --bind-to core pins
paratrain's. Prints one JSON line: steps/s (median of 3 trials) and the largest peak
RSS over the ranks.

  OMP_NUM_THREADS=1 /usr/bin/python3 benchmarks/zero_vs_torch.py --mode zero1 --layers 4
"""
import argparse
import json
import os
import resource
import time

import peer


def run(rank, args):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    peer.join(rank, args.ranks, bind=True)
    torch.manual_seed(1 + rank)
    width, batch, pool = 2048, 32, 8
    x = torch.randn(pool * batch, width)
    y = torch.randint(0, 10, (pool * batch,))
    layers = []
    for _ in range(args.layers):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = DistributedDataParallel(nn.Sequential(*layers, nn.Linear(width, 10)))
    if args.mode == "zero1":
        optim = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4)
    else:
        optim = torch.optim.Adam(model.parameters(), lr=1e-4)
    counter = [0]

    def step():
        start = (counter[0] % pool) * batch
        counter[0] += 1
        optim.zero_grad()
        loss = F.cross_entropy(model(x[start:start + batch]), y[start:start + batch])
        loss.backward()
        loss.item()  # as paratrain's DataParallel::step reads the loss
        optim.step()

    for _ in range(args.warmup):
        step()
    per_trial = args.steps // 3
    seconds = []
    for _ in range(3):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(per_trial):
            step()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # ended by the slowest rank
        seconds.append(elapsed.item() / per_trial)
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0], dtype=torch.float64)
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(json.dumps({
            "implementation": "pytorch", "strategy": args.mode, "version": torch.__version__, "ranks": args.ranks,
            "layers": args.layers, "parameters": sum(p.numel() for p in model.parameters()), "batch_per_rank": batch,
            "steps": per_trial * 3, "steps_per_s": round(1 / sorted(seconds)[1], 3),
            "peak_rss_mib": round(rss.item(), 1)}), flush=True)
    dist.barrier()  # no rank leaves while another still talks to it: gloo's teardown hangs then
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["ddp", "zero1"], default="zero1")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=30, help="timed steps, in 3 trials")
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    peer.spawn(run, args, args.ranks)


if __name__ == "__main__":
    main()

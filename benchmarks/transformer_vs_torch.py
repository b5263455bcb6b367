#!/usr/bin/python3
"""The seed's program: torch.nn.Transformer trained with PyTorch's own DDP (gloo).

The model and data of examples/transformer (its transformer_ddp build is the other side
of benchmarks/transformer_vs_torch.sh): torch.nn.Transformer(batch_first=True) in its
default configuration (d_model 512, 8 heads, 6 + 6 layers, feed-forward 2048, dropout
0.1; 44.1M parameters), synthetic src = torch.rand(2048, 1, 512) and
tgt = torch.rand(2048, 20, 512), batch 32 per rank through a DistributedSampler,
Adam(lr=0.001 * world_size), loss CrossEntropyLoss()(model(src, tgt), tgt) (float
targets: class probabilities over dim 1). One intra-op thread per rank.

Trains --steps steps in all and leaves the first --warmup of them out of the timing, as
transformer_ddp's --steps and --warmup do. Ranks are processes
started with torch.multiprocessing.spawn, rendezvous by env:// on 127.0.0.1 and a free
port. Prints one JSON line: ms_per_step is the slowest rank's mean over the timed steps.

  OMP_NUM_THREADS=1 /usr/bin/python3 benchmarks/transformer_vs_torch.py --ranks 2 --steps 8 --warmup 2 [--bind]
"""
import argparse
import json
import math
import os
import time

import peer


def run(rank, args):
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    peer.join(rank, args.ranks, bind=args.bind)
    world = dist.get_world_size()

    torch.manual_seed(args.seed)
    src = torch.rand(args.samples, 1, 512)
    tgt = torch.rand(args.samples, 20, 512)
    data = TensorDataset(src, tgt)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler)
    if args.steps > len(loader):
        raise SystemExit(f"--steps {args.steps} is more than an epoch ({len(loader)} steps); raise --samples")

    model = DistributedDataParallel(nn.Transformer(batch_first=True))  # defaults: bucket_cap_mb=25
    optimizer = torch.optim.Adam(model.parameters(), lr=0.001 * world)
    criterion = nn.CrossEntropyLoss()

    seconds, losses = [], []
    batches = iter(loader)
    for step in range(args.steps):
        if step == args.warmup:
            dist.barrier()  # the timed steps start together
        start = time.perf_counter()  # the batch's gathering included, as in paratrain's fit
        s, t = next(batches)
        optimizer.zero_grad()
        loss = criterion(model(s, t), t)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())  # as paratrain reads the loss every step
        seconds.append(time.perf_counter() - start)
        if rank == 0:
            print(f"step {step + 1}/{args.steps}: {1e3 * seconds[-1]:.1f} ms, loss {losses[-1]:.6f}", flush=True)

    timed = torch.tensor([sum(seconds[args.warmup:])], dtype=torch.float64)
    dist.all_reduce(timed, op=dist.ReduceOp.MAX)  # the slowest rank
    last = torch.tensor([losses[-1]], dtype=torch.float64)
    dist.all_reduce(last)
    measured = len(seconds) - args.warmup
    if rank == 0:
        loss = last.item() / world
        print(json.dumps({
            "implementation": "pytorch", "version": torch.__version__, "strategy": "ddp", "world_size": world,
            "batch_per_replica": args.batch, "parameters": sum(p.numel() for p in model.parameters()),
            "steps": len(seconds), "warmup": args.warmup,
            "loss": loss if math.isfinite(loss) else None,
            "ms_per_step": round(1e3 * timed.item() / measured, 1) if measured > 0 else None,
            "threads": torch.get_num_threads(), "bind": args.bind}), flush=True)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=8, help="steps in all, warm-up included")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the timing")
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--batch", type=int, default=32, help="per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bind", action="store_true", help="pin rank r to core r")
    args = p.parse_args()
    peer.spawn(run, args, args.ranks)


if __name__ == "__main__":
    main()

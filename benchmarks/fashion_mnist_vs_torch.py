#!/usr/bin/python3
"""The Fashion-MNIST demo's training in PyTorch's own DDP (gloo), for time-to-90%.

The same CNN as examples/fashion_mnist/net.hpp (conv 1->16 5x5, batch norm, ReLU, max
pool; conv 16->32 5x5, batch norm, ReLU, max pool; linear 512->128, ReLU, 128->10), the
same data (Debian's gzipped IDX files, normalised with mean 0.2860, std 0.3530), Adam
2e-3 with the same per-step cosine decay, batch 64 per rank, DistributedSampler (seed 0),
evaluation of the whole test set sharded over the ranks after each epoch, one intra-op
thread per rank, each rank bound to its own core. Times count from process start, as
the C++ demo's do. Prints one JSON line like the demo's summary.

  OMP_NUM_THREADS=1 /usr/bin/python3 benchmarks/fashion_mnist_vs_torch.py --ranks 2 --epochs 5
"""
import argparse
import gzip
import json
import math
import os
import time

import peer

START = time.time()


def read_idx(path):
    import numpy as np
    with gzip.open(path, "rb") as f:
        data = f.read()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def run(rank, args):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DistributedSampler

    peer.join(rank, args.ranks)

    def load(prefix):
        x = torch.from_numpy(read_idx(f"{args.data}/{prefix}-images-idx3-ubyte.gz").copy()).float().div_(255)
        x = x.sub_(0.2860).div_(0.3530).unsqueeze(1).contiguous()
        y = torch.from_numpy(read_idx(f"{args.data}/{prefix}-labels-idx1-ubyte.gz").copy()).long()
        return x, y

    (xtr, ytr), (xte, yte) = load("train"), load("t10k")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 16, 5), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Conv2d(16, 32, 5), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Flatten(), nn.Linear(512, 128), nn.ReLU(), nn.Linear(128, 10))
    device = torch.device(args.device)
    net.to(device)
    # One rank: the plain model (what fashion_mnist_single trains), else PyTorch's DDP.
    model = DistributedDataParallel(net) if args.ranks > 1 else net
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sampler = DistributedSampler(range(len(xtr)), num_replicas=args.ranks, rank=rank, shuffle=True, seed=0)
    steps = math.ceil(sampler.num_samples / args.batch)
    seconds_to_90, accuracy, samples, train_seconds = None, 0.0, 0, 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        idx = torch.tensor(list(iter(sampler)))
        model.train()
        begin = time.time()
        for k in range(steps):
            for g in opt.param_groups:
                g["lr"] = args.lr * 0.5 * (1 + math.cos(math.pi * (epoch + k / steps) / args.epochs))
            b = idx[k * args.batch:(k + 1) * args.batch]
            opt.zero_grad()
            F.cross_entropy(model(xtr[b].to(device, non_blocking=True)), ytr[b].to(device, non_blocking=True)).backward()
            opt.step()
            samples += len(b) * args.ranks
        train_seconds += time.time() - begin
        model.eval()
        with torch.no_grad():
            shard = torch.arange(rank, len(xte), args.ranks)
            correct = torch.tensor([0.0, 0.0])
            for i in range(0, len(shard), 1000):
                s = shard[i:i + 1000]
                correct += torch.tensor([(model(xte[s].to(device)).argmax(1) == yte[s].to(device)).sum().item(), len(s)])
            dist.all_reduce(correct)
            accuracy = (correct[0] / correct[1]).item()
        if seconds_to_90 is None and accuracy >= 0.90:
            seconds_to_90 = time.time() - START
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}: test accuracy {100 * accuracy:.2f}%", flush=True)
    if rank == 0:
        print(json.dumps({"implementation": "pytorch", "strategy": "ddp" if args.ranks > 1 else "single",
                          "world_size": args.ranks, "device": args.device,
                          "epochs": args.epochs, "test_accuracy": round(accuracy, 4),
                          "samples_per_second": round(samples / train_seconds, 1),
                          "wall_seconds": round(time.time() - START, 2), "seconds_to_90": seconds_to_90}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--device", default="cpu", help="cpu or cuda (one rank: the plain model, no DDP)")
    args = p.parse_args()
    peer.spawn(run, args, args.ranks)

#!/usr/bin/python3
"""The PyTorch reference program: torch.nn.Transformer trained with PyTorch's own DDP (gloo).

The model and data of examples/transformer (its transformer_ddp build is the other side
of benchmarks/transformer_vs_torch.sh): torch.nn.Transformer(batch_first=True) in its
default configuration (d_model 512, 8 heads, 6 + 6 layers, feed-forward 2048, dropout
0.1; 44.1M parameters), synthetic src = torch.rand(2048, 1, 512) and
tgt = torch.rand(2048, 20, 512), batch 32 per rank through a DistributedSampler,
Adam(lr=0.001 * world_size), loss CrossEntropyLoss()(model(src, tgt), tgt) (float
targets: class probabilities over dim 1). One intra-op thread per rank.

With --data FILE the samples are read from an HDF5 file (datasets "src" and "tgt", as
transformer_single --write-data writes them) through h5py, one sample per __getitem__, the
file opened by each process that reads (the usual h5py Dataset); --workers N is the
DataLoader's num_workers (0: the training process reads each batch when it needs it, as
PyTorch's default), with its default prefetch_factor (2 batches per worker).

With --recompute every encoder and decoder layer runs under torch.utils.checkpoint
(use_reentrant=False: the variant PyTorch's DDP supports), as transformer_ddp --recompute
recomputes them. With --bf16 forward and the loss run under torch.autocast("cpu",
torch.bfloat16), as transformer_ddp --bf16 runs them; DDP still sums the gradients in fp32:
PyTorch 1.13's bf16_compress_hook refuses anything but NCCL ("BF16 all reduce communication
hook required CUDA 11+ and NCCL 2.10+"), and this machine's DDP runs over gloo. --tgt-len sets the target's length (20).

Trains --steps steps in all and leaves the first --warmup of them out of the timing, as
transformer_ddp's --steps and --warmup do. Ranks are processes
started with torch.multiprocessing.spawn, rendezvous by env:// on 127.0.0.1 and a free
port. Prints one JSON line: ms_per_step is the slowest rank's mean over the timed steps, and
data_ms_per_step the slowest rank's mean wait for the next batch within them.

  OMP_NUM_THREADS=1 /usr/bin/python3 benchmarks/transformer_vs_torch.py --ranks 2 --steps 8 --warmup 2 [--bind]
      [--data data.h5] [--workers N]
"""
import argparse
import functools
import json
import math
import os
import resource
import time

import peer


class H5Samples:
    """torch.utils.data.Dataset over the HDF5 file's src and tgt, read one sample at a time
    by h5py; each process opens the file on its first read (h5py handles do not cross fork)."""

    def __init__(self, path):
        import h5py
        self.path, self.file = path, None
        with h5py.File(path, "r") as f:
            self.n = len(f["src"])

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import h5py
        import torch
        if self.file is None:
            self.file = h5py.File(self.path, "r")
        return torch.from_numpy(self.file["src"][i]), torch.from_numpy(self.file["tgt"][i])


def run(rank, args):
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    peer.join(rank, args.ranks, bind=args.bind)
    world = dist.get_world_size()

    torch.manual_seed(args.seed)
    if args.data:
        data = H5Samples(args.data)
    else:
        src = torch.rand(args.samples, 1, 512)
        tgt = torch.rand(args.samples, args.tgt_len, 512)
        data = TensorDataset(src, tgt)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler, num_workers=args.workers)
    if args.steps > len(loader):
        raise SystemExit(f"--steps {args.steps} is more than an epoch ({len(loader)} steps); raise --samples")

    transformer = nn.Transformer(batch_first=True)
    if args.recompute:
        from torch.utils.checkpoint import checkpoint
        for layer in [*transformer.encoder.layers, *transformer.decoder.layers]:
            layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
    device = torch.device(args.device)
    transformer.to(device)
    # One rank: the plain model (what transformer_single trains), else PyTorch's DDP.
    model = DistributedDataParallel(transformer) if world > 1 else transformer  # defaults: bucket_cap_mb=25
    optimizer = torch.optim.Adam(model.parameters(), lr=0.001 * world)
    criterion = nn.CrossEntropyLoss()

    seconds, waits, losses = [], [], []
    batches = iter(loader)
    for step in range(args.steps):
        if step == args.warmup:
            dist.barrier()  # the timed steps start together
        start = time.perf_counter()  # the batch's gathering included, as in paratrain's fit
        s, t = next(batches)
        s, t = s.to(device, non_blocking=True), t.to(device, non_blocking=True)
        waits.append(time.perf_counter() - start)
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            loss = criterion(model(s, t), t)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())  # as paratrain reads the loss every step
        seconds.append(time.perf_counter() - start)
        if rank == 0:
            print(f"step {step + 1}/{args.steps}: {1e3 * seconds[-1]:.1f} ms, loss {losses[-1]:.6f}", flush=True)

    timed = torch.tensor([sum(seconds[args.warmup:]), sum(waits[args.warmup:])], dtype=torch.float64)
    dist.all_reduce(timed, op=dist.ReduceOp.MAX)  # the slowest rank
    last = torch.tensor([losses[-1]], dtype=torch.float64)
    dist.all_reduce(last)
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0], dtype=torch.float64)  # KiB
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    measured = len(seconds) - args.warmup
    if rank == 0:
        loss = last.item() / world
        print(json.dumps({
            "implementation": "pytorch", "version": torch.__version__, "strategy": "ddp" if world > 1 else "single",
            "world_size": world, "device": args.device,
            "batch_per_replica": args.batch, "parameters": sum(p.numel() for p in model.parameters()),
            "steps": len(seconds), "warmup": args.warmup,
            "loss": loss if math.isfinite(loss) else None,
            "ms_per_step": round(1e3 * timed[0].item() / measured, 1) if measured > 0 else None,
            "data_ms_per_step": round(1e3 * timed[1].item() / measured, 3) if measured > 0 else None,
            "data": "hdf5" if args.data else "memory", "workers": args.workers,
            "recompute": args.recompute, "bf16": args.bf16, "tgt_len": args.tgt_len, "peak_rss_mib_max": round(peak.item(), 1),
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
    p.add_argument("--data", help="an HDF5 file with datasets src and tgt, read by h5py")
    p.add_argument("--workers", type=int, default=0, help="DataLoader's num_workers")
    p.add_argument("--tgt-len", type=int, default=20, help="the target's length")
    p.add_argument("--recompute", action="store_true", help="torch.utils.checkpoint around every layer")
    p.add_argument("--device", default="cpu", help="cpu or cuda (one rank: the plain model, no DDP)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (gradients still summed in fp32: gloo)")
    args = p.parse_args()
    peer.spawn(run, args, args.ranks)


if __name__ == "__main__":
    main()

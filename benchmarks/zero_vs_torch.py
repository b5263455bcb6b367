"""PyTorch's DDP, ZeroRedundancyOptimizer (ZeRO-1) and FSDP on the model and data of benchmarks/zero.hpp.

MLP of `layers` x Linear(2048, 2048) with ReLU and a Linear(2048, 10) head, Adam(lr 1e-4),
cross-entropy, batch 32 per rank of random inputs and labels, one intra-op thread per rank.
--mode ddp: DistributedDataParallel with its defaults; --mode zero1: the same DDP with
torch.distributed.optim.ZeroRedundancyOptimizer(Adam); --mode fsdp (PyTorch >= 2.6, which
has torch.distributed.fsdp.fully_shard; not Debian 12's 1.13): every Linear and then the
whole model fully_shard-ed, ZeRO-3 with a unit per layer as paratrain's Unit makes it.

--device cpu (default): gloo, ranks spawned with torch.multiprocessing and pinned to one core
each as mpirun --bind-to core pins paratrain's (benchmarks/zero_vs_torch.sh). --device cuda:
nccl, rank r on GPU r, the data made on the GPU as bench_zero_rendezvous makes it, and the
peak of CUDA's caching allocator (torch.cuda.max_memory_allocated) printed as peak_gpu_mib
(scripts/gpu-check.sh). Prints one JSON line: steps/s (median of 3 trials) and the largest
peaks over the ranks.

  OMP_NUM_THREADS=1 /usr/bin/python3 benchmarks/zero_vs_torch.py --mode zero1 --layers 4
"""
import argparse
import json
import resource
import time

import peer


def run(rank, args):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    peer.join(rank, args.ranks, bind=not cuda, backend="nccl" if cuda else "gloo")
    torch.manual_seed(1 + rank)
    width, batch, pool = 2048, 32, 8
    x = torch.randn(pool * batch, width).to(device)
    y = torch.randint(0, 10, (pool * batch,)).to(device)
    layers = []
    for _ in range(args.layers):
        layers += [nn.Linear(width, width), nn.ReLU()]
    net = nn.Sequential(*layers, nn.Linear(width, 10)).to(device)
    if args.mode == "fsdp":
        from torch.distributed.fsdp import fully_shard  # PyTorch >= 2.6

        for layer in net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        model = fully_shard(net)
    else:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(net, device_ids=[rank] if cuda else None)
    if args.mode == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer

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

    def largest(v):  # over the ranks
        t = torch.tensor([v], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    for _ in range(args.warmup):
        step()
    per_trial = args.steps // 3
    seconds = []
    for _ in range(3):
        if cuda:
            torch.cuda.synchronize(device)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(per_trial):
            step()
        if cuda:
            torch.cuda.synchronize(device)
        seconds.append(largest(time.perf_counter() - start) / per_trial)  # ended by the slowest rank
    rss = largest(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0)
    result = {
        "implementation": "pytorch", "strategy": args.mode, "version": torch.__version__, "device": str(device),
        "ranks": args.ranks, "layers": args.layers, "parameters": sum(p.numel() for p in net.parameters()),  # FSDP's: DTensors, whole sizes
        "batch_per_rank": batch, "steps": per_trial * 3, "steps_per_s": round(1 / sorted(seconds)[1], 3),
        "peak_rss_mib": round(rss, 1)}
    if cuda:
        result["peak_gpu_mib"] = round(largest(torch.cuda.max_memory_allocated(device) / 2**20), 1)
    if rank == 0:
        print(json.dumps(result), flush=True)
    dist.barrier()  # no rank leaves while another still talks to it: gloo's teardown hangs then
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["ddp", "zero1", "fsdp"], default="zero1")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--steps", type=int, default=30, help="timed steps, in 3 trials")
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    if args.mode == "fsdp":
        import torch

        if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 6):
            p.error(f"--mode fsdp needs PyTorch >= 2.6 (torch.distributed.fsdp.fully_shard); this is {torch.__version__}")
    peer.spawn(run, args, args.ranks)


if __name__ == "__main__":
    main()

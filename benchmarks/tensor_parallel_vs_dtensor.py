#!/usr/bin/python3
"""The PyTorch side of the tensor-parallelism benchmark: PyTorch's own DTensor tensor
parallelism (torch.distributed.tensor.parallel.parallelize_module, Gloo, CPU) on the stack of
pre-norm GPT blocks that paratrain's tp::TransformerBlock makes. Needs PyTorch >= 2.6 (not
Debian 12's 1.13): run it in scripts/peer-root.sh's Debian 13 root.

The model: torch.manual_seed(seed), then `layers` blocks, each built in paratrain's order (ln1,
attention q, k, v, out, two draws of torch.randint(1 << 62, (1,)) where paratrain's attention
and first residual dropouts draw their keys, ln2, mlp fc1, fc2, one draw for the second
residual dropout), so that both sides start from the same weights; dropout 0. A block:
x + out(causal attention(q, k, v of ln1(x))), then + fc2(gelu(fc1(ln2(x)))) (exact gelu).
Data: torch.manual_seed(seed + 1), x and target torch.randn(batch, seq, hidden), the same on
every rank (tensor parallelism alone); loss mse_loss(model(x), target), SGD(lr, momentum).

--device cuda: rank r on GPU r over NCCL (as many GPUs as ranks), the model built on the CPU
from the seed and moved there, the data too; each step's time waits for the GPU.

Each block is parallelize_module-d over a 1-D mesh of all ranks (init_device_mesh("cpu")):
q, k, v and fc1 ColwiseParallel, out and fc2 RowwiseParallel (two all-reduces forward, two
backward). --sequence-parallel: torchtitan's plan, ln1/ln2 SequenceParallel, the attention
and MLP inputs all-gathered from Shard(1) by PrepareModuleInput, out and fc2
RowwiseParallel(output_layouts=Shard(1)): the residual stream between the blocks is this
rank's sequence shard, x and target are cut the same way and the loss is this rank's share
(sum of squares / the whole's element count; the ranks' shares summed for the report); the
layer norms' gradients (Partial under SP) are all-reduced before each SGD step (whole_grads).
--no-parallelize: the plain model (one rank), the reference the weights are checked against.

Ranks are processes started by torch.multiprocessing.spawn (peer.py), one intra-op thread
each, pinned to core r with --bind. Trains --steps steps, the first --warmup left out of the
timing. Prints one JSON line: ms_per_step is the slowest rank's mean over the timed steps;
loss_first and loss_last the loss of the first and last step. --weights-out PATH writes the
final parameters whole (DTensor.full_tensor()), float32 little-endian, concatenated in
named_parameters() order (blocks.<i>.ln1.weight, ...), and PATH.json with their names and
shapes (benchmarks/compare_weights.py compares two such files).

  scripts/peer-root.sh env OMP_NUM_THREADS=1 python3 benchmarks/tensor_parallel_vs_dtensor.py --ranks 2 --bind
"""
import argparse
import array
import json
import math
import os
import sys
import time

import peer


def build(args):
    """The model, its random draws in tp::TransformerBlock's order."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    def key():
        torch.randint(1 << 62, (1,))  # a tp::Dropout's key: drawn, not used (dropout 0)

    class Attention(nn.Module):
        def __init__(self, h, heads):
            super().__init__()
            self.d = h // heads
            self.q, self.k, self.v, self.out = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
            key()  # the attention probabilities' dropout

        def forward(self, a):
            b, s = a.shape[0], a.shape[1]  # the whole sequence (under SP `a` is the gathered DTensor)

            def heads(t):  # [b, s, heads here, d]: this rank's heads under TP
                return t.view(b, s, -1, self.d).transpose(1, 2)

            q, k, v = heads(self.q(a)), heads(self.k(a)), heads(self.v(a))
            scores = q @ k.transpose(-2, -1) / math.sqrt(self.d)
            scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=a.device).triu(1), float("-inf"))
            mixed = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1)
            return self.out(mixed)

    class Mlp(nn.Module):
        def __init__(self, h, ffn):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(h, ffn), nn.Linear(ffn, h)

        def forward(self, x):
            return self.fc2(F.gelu(self.fc1(x)))

    class Block(nn.Module):
        def __init__(self, h, heads, ffn):
            super().__init__()
            self.ln1 = nn.LayerNorm(h, eps=1e-5)
            self.attention = Attention(h, heads)
            key()  # the first residual dropout
            self.ln2 = nn.LayerNorm(h, eps=1e-5)
            self.mlp = Mlp(h, ffn)
            key()  # the second residual dropout

        def forward(self, x):
            x = x + self.attention(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block(args.hidden, args.heads, args.ffn) for _ in range(args.layers))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    torch.manual_seed(args.seed)
    return Stack()


def plan(sequence_parallel):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    if not sequence_parallel:
        return {"attention.q": ColwiseParallel(), "attention.k": ColwiseParallel(), "attention.v": ColwiseParallel(),
                "attention.out": RowwiseParallel(), "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()}
    gather = dict(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {"ln1": SequenceParallel(), "attention": PrepareModuleInput(**gather),
            "attention.q": ColwiseParallel(), "attention.k": ColwiseParallel(), "attention.v": ColwiseParallel(),
            "attention.out": RowwiseParallel(output_layouts=Shard(1)),
            "ln2": SequenceParallel(), "mlp": PrepareModuleInput(**gather),
            "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel(output_layouts=Shard(1))}


def whole_grads(model):
    """Under SP the layer norms' gradients come out Partial(sum) (each rank's from its sequence
    shard) while their weights are Replicate: all-reduced here, before SGD. Left Partial, SGD
    with momentum goes wrong in PyTorch 2.6 (without momentum it is right): the momentum buffer
    is then Partial too, and an in-place multiply of a Partial DTensor by a number leaves it as
    it was (measured: x.mul_(0.5) of a Partial x gathers to the same values; x * 0.5 is right),
    so buf.mul_(momentum) does not decay the buffer, and after 20 steps the layer norms'
    weights differ from the one-rank run's by up to ~0.9 of their size."""
    from torch.distributed.tensor import DTensor, Partial

    for p in model.parameters():
        g = p.grad
        if isinstance(g, DTensor) and any(isinstance(q, Partial) for q in g.placements):
            p.grad = g.redistribute(placements=p.placements)


def write_weights(model, path, rank):
    """Every parameter whole (all ranks gather), float32 LE, in named_parameters() order; rank 0 writes."""
    import torch
    from torch.distributed.tensor import DTensor

    index, data = [], array.array("f")
    for name, p in model.named_parameters():
        whole = p.full_tensor() if isinstance(p, DTensor) else p
        index.append({"name": name, "shape": list(whole.shape)})
        data.extend(whole.detach().to(torch.float32).reshape(-1).tolist())
    if rank != 0:
        return
    if sys.byteorder != "little":
        data.byteswap()
    with open(path, "wb") as f:
        data.tofile(f)
    with open(path + ".json", "w") as f:
        json.dump(index, f)


def run(rank, args):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)  # a GPU per rank: NCCL takes no two ranks on one
    peer.join(rank, args.ranks, bind=args.bind, backend="nccl" if cuda else "gloo")
    t = dist.get_world_size()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    model = build(args).to(device)  # built on the CPU from the seed, as paratrain builds its slices
    if not args.no_parallelize:
        mesh = init_device_mesh(device.type, (t,))
        for block in model.blocks:
            parallelize_module(block, mesh, plan(args.sequence_parallel))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)

    torch.manual_seed(args.seed + 1)
    x = torch.randn(args.batch, args.seq, args.hidden)
    target = torch.randn(args.batch, args.seq, args.hidden)
    whole = target.numel()
    if args.sequence_parallel:  # this rank's sequence shard, as Shard(1) cuts it
        x, target = x.chunk(t, dim=1)[rank].contiguous(), target.chunk(t, dim=1)[rank].contiguous()
    x, target = x.to(device), target.to(device)

    seconds, losses = [], []
    for step in range(args.steps):
        if step == args.warmup:
            dist.barrier()  # the timed steps start together
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        optimizer.zero_grad()
        y = model(x)
        if isinstance(y, DTensor):  # not with this plan (use_local_output), but in case
            y = y.to_local()
        # This rank's share of the mean: the whole loss under TP, a part of it under SP.
        loss = F.mse_loss(y, target, reduction="sum") / whole if args.sequence_parallel else F.mse_loss(y, target)
        loss.backward()
        if args.sequence_parallel:
            whole_grads(model)
        optimizer.step()
        losses.append(loss.item())  # as paratrain reads the loss every step
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        if rank == 0 and args.verbose:
            print(f"step {step + 1}/{args.steps}: {1e3 * seconds[-1]:.1f} ms, loss {losses[-1]:.6f}",
                  file=sys.stderr, flush=True)

    measured = len(seconds) - args.warmup
    timed = torch.tensor([sum(seconds[args.warmup:]) / max(measured, 1)], dtype=torch.float64, device=device)
    dist.all_reduce(timed, op=dist.ReduceOp.MAX)  # the slowest rank's mean
    shares = torch.tensor([losses[0], losses[-1]], dtype=torch.float64, device=device)
    if args.sequence_parallel:
        dist.all_reduce(shares)  # the ranks' shares of each loss
    if args.weights_out:
        write_weights(model, args.weights_out, rank)
    if rank == 0:
        print(json.dumps({
            "implementation": "pytorch-dtensor" if not args.no_parallelize else "pytorch-plain",
            "torch": torch.__version__, "world_size": t, "tensor_parallel": 1 if args.no_parallelize else t,
            "sequence_parallel": args.sequence_parallel,
            "layers": args.layers, "hidden": args.hidden, "heads": args.heads, "ffn": args.ffn,
            "batch": args.batch, "seq": args.seq, "steps": args.steps, "warmup": args.warmup,
            "ms_per_step": round(1e3 * timed.item(), 3) if measured > 0 else None,
            "parameters": sum(p.numel() for p in model.parameters()),  # DTensor: the whole's count
            "loss_first": shares[0].item(), "loss_last": shares[1].item(),
            "threads": torch.get_num_threads(), "bind": args.bind, "device": device.type}), flush=True)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2, help="the tensor-parallel degree (all ranks)")
    p.add_argument("--steps", type=int, default=20, help="steps in all, warm-up included")
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of the timing")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--bind", action="store_true", help="pin rank r to core r")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu (Gloo) or cuda (NCCL, rank r on GPU r: as many GPUs as ranks)")
    p.add_argument("--weights-out", metavar="PATH", help="write the final weights to PATH (and PATH.json)")
    p.add_argument("--sequence-parallel", action="store_true", help="torchtitan's sequence-parallel plan")
    p.add_argument("--no-parallelize", action="store_true", help="the plain model, no parallelize_module (one rank)")
    p.add_argument("--verbose", action="store_true", help="each step's time and loss on stderr")
    args = p.parse_args()
    if args.hidden % args.heads:
        p.error("--hidden must be a multiple of --heads")
    if args.no_parallelize and (args.ranks != 1 or args.sequence_parallel):
        p.error("--no-parallelize is the one-rank reference: --ranks 1, no --sequence-parallel")
    if args.heads % args.ranks or args.ffn % args.ranks:
        p.error("--heads and --ffn must be multiples of --ranks")
    if args.sequence_parallel and args.seq % args.ranks:
        p.error("--sequence-parallel needs --seq a multiple of --ranks")
    if not 0 <= args.warmup < args.steps:
        p.error("--warmup must be in [0, --steps)")
    # Debian's PyTorch 2.6 is built without libuv, which env://'s TCPStore asks for by default
    # ("use_libuv was requested but PyTorch was build without libuv support"): its other server.
    os.environ.setdefault("USE_LIBUV", "0")
    peer.spawn(run, args, args.ranks)


if __name__ == "__main__":
    main()

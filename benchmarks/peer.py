"""The PyTorch side of the *_vs_torch benchmarks: one process group of spawned ranks (gloo;
nccl for ranks on GPUs), each on one intra-op thread, optionally pinned to its core as
`mpirun --bind-to core` pins paratrain's ranks."""
import os
import socket


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join(rank, ranks, bind=True, backend="gloo"):
    """In a spawned rank: pin it (bind), one thread, join the `backend` group of `ranks`."""
    import torch
    import torch.distributed as dist

    if bind:
        os.sched_setaffinity(0, {rank % os.cpu_count()})
    torch.set_num_threads(1)
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(ranks)
    dist.init_process_group(backend, init_method="env://")


def spawn(run, args, ranks):
    """Runs run(rank, args) in `ranks` processes that can join one group on this machine."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    import torch.multiprocessing as mp

    mp.spawn(run, args=(args,), nprocs=ranks)

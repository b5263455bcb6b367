#!/usr/bin/python3
"""The layer check: every #include of a paratrain header runs down the layers or stays in
its own folder, and a folder's detail/ is included only from that folder.

The layers, bottom to top, are the table below (docs/architecture.md draws them). A header
may include headers of its own folder and of folders listed before it; a header in X/detail/
(or X/Y/detail/) may be included only by headers under X/. Forwarding headers (a line
`// paratrain: moved to ...`) stand above every layer: they exist for old include paths.

Usage: layers.py [INCLUDE_DIR]   (default: include/ beside this repository's tests/)
Prints one line per broken rule: file:line: the include, and the rule it breaks.
"""
import pathlib
import re
import sys

# Folder (first path component under paratrain/) -> what it holds. Order is the layer order.
LAYERS = [
    ("core", "vocabulary: error, config, reduce_op, Batch, StepResult, the step timeline probe, the backward scale"),
    ("util", "utilities with no paratrain vocabulary of their own: hashes, LibTorch version shims"),
    ("memory", "the process's memory: the heap's settings, mapped construction, pooled transients, tensor counts, usage"),
    ("plan", "the memory model: per-rank bytes and the peak of a step under DDP and ZeRO, from sizes alone"),
    ("concepts", "what a communicator, module, optimizer, dataset, sampler and strategy must offer; the optimizer-state schema"),
    ("collectives", "algorithms on any communicator: agreement, string gathers, coalescing"),
    ("reliability", "the watchdog, the collective ledger and fingerprint, failure reports"),
    ("comm", "transports: single device, and one folder per backend (mpi/, gloo/, nccl/)"),
    ("data", "datasets, samplers, the loader; hdf5/ for the HDF5 component"),
    ("tensor_parallel", "tensor and sequence parallelism: tensor groups, the layers cut over them, keyed dropout"),
    ("context", "context parallelism: attention over a sequence cut across a context group (ring, all-to-all), its layouts"),
    ("experts", "mixtures of experts: the router, the experts cut over an expert group, the all-to-all dispatch and combine"),
    ("strategy", "DDP, ZeRO, local data parallel, precision, recomputation; buckets/ and stores/"),
    ("pipeline", "pipeline schedules, stages, links and the pipeline strategy"),
    ("checkpoint", "checkpoint files: format, writing, loading, resharding"),
    ("observe", "observers: metrics logs, traces, TensorBoard, step times"),
    ("fit", "the training loop: options, evaluation, metrics, checkpoints, progress"),
    ("elastic", "recovery without a restart: generations of Gloo groups, the survivors' snapshot, elastic::fit"),
    ("program", "a training program's main: paratrain::main, its set-up and what ends with it"),
]
RANK = {name: i for i, (name, _) in enumerate(LAYERS)}
TOP = len(LAYERS)  # paratrain.hpp and forwarding headers
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]paratrain/([^">]+)[">]')
MOVED = "// paratrain: moved to "


def place(rel):
    """(layer rank, folder) of a header path relative to include/paratrain/."""
    parts = rel.split("/")
    return (RANK.get(parts[0]), parts[0]) if len(parts) > 1 else (TOP, "")


def detail_owner(rel):
    """The folder whose detail/ holds `rel` (e.g. 'comm/mpi' for comm/mpi/detail/types.hpp), or None."""
    parts = rel.split("/")
    return "/".join(parts[: parts.index("detail")]) if "detail" in parts[:-1] else None


def check(root):
    problems = []
    headers = sorted(p for p in root.rglob("*.hpp"))
    for path in headers:
        rel = path.relative_to(root).as_posix()
        rank, folder = place(rel)
        text = path.read_text().splitlines()
        moved = any(line.startswith(MOVED) for line in text)
        if rank is None:
            problems.append(f"{path}:1: folder '{folder}/' is not a layer (tests/static/layers.py, LAYERS)")
            continue
        if rank == TOP and not moved and rel != "paratrain.hpp":
            problems.append(f"{path}:1: only paratrain.hpp and forwarding headers stand at the root")
        for n, line in enumerate(text, 1):
            m = INCLUDE.match(line)
            if not m:
                continue
            target = m.group(1)
            if not (root / target).is_file():
                problems.append(f"{path}:{n}: includes paratrain/{target}, which does not exist")
                continue
            t_rank, t_folder = place(target)
            if moved:
                continue
            if t_rank == TOP and target != "paratrain.hpp":
                problems.append(f"{path}:{n}: includes paratrain/{target}, a forwarding header: include the "
                                "header it names")
            elif t_rank is not None and t_rank > rank:
                problems.append(f"{path}:{n}: includes paratrain/{target}: '{folder}/' (layer {rank}) may not "
                                f"include '{t_folder}/' (layer {t_rank}): includes run down the layers")
            owner = detail_owner(target)
            if owner and not rel.startswith(owner + "/"):
                problems.append(f"{path}:{n}: includes paratrain/{target}: {owner}/detail/ is private to {owner}/")
    return problems, len(headers)


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else
                        pathlib.Path(__file__).resolve().parents[2] / "include") / "paratrain"
    problems, count = check(root)
    for p in problems:
        print(p)
    if problems:
        print(f"layers: {len(problems)} broken rule(s) in {count} headers (the layers: tests/static/layers.py)")
        return 1
    print(f"layers: {count} headers, every include runs down the layers")
    return 0


if __name__ == "__main__":
    sys.exit(main())

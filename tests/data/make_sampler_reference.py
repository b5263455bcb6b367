#!/usr/bin/python3
"""Write tests/data/sampler_reference.json: what PyTorch's DistributedSampler yields, and
what its WeightedRandomSampler yields ("weighted") for paratrain's WeightedSampler.

tests/unit/sampler_test.cpp checks paratrain::data::DistributedSampler against every
case recorded here, so the C++ sampler is compared with PyTorch and never with itself.

Rerun from the repository root, with the PyTorch peer installed
(PARATRAIN_WITH_PEER=1 scripts/deps.sh installs python3-torch):

    /usr/bin/python3 tests/data/make_sampler_reference.py

The output is deterministic: the same PyTorch version writes the same bytes, so a
diff of the JSON after a rerun shows exactly what changed upstream. PyTorch 1.x writes
sampler_reference.json (made with Debian 12's python3-torch 1.13), 2.x
sampler_reference_torch2.json (made with Debian 13's 2.6, in scripts/compat.sh's root with
python3-torch added); the version is recorded in each file.
"""

import json
import pathlib

import torch
from torch.utils.data import DistributedSampler, WeightedRandomSampler

SIZES = [0, 1, 2, 7, 10, 11, 17, 100, 1001]
REPLICAS = [1, 2, 3, 4, 8]
# The large seed lies beyond int64, so the test also covers seeds only a uint64 holds.
SEEDS = [0, 42, 2**63 + 2**40 + 7]
EPOCHS = [0, 1, 5]


def record(n, num_replicas, rank, shuffle, seed, epoch, drop_last):
    # A range has the __len__ DistributedSampler needs and nothing else.
    sampler = DistributedSampler(range(n), num_replicas=num_replicas, rank=rank,
                                 shuffle=shuffle, seed=seed, drop_last=drop_last)
    sampler.set_epoch(epoch)
    return {
        "params": {"dataset_size": n, "num_replicas": num_replicas, "rank": rank,
                   "shuffle": shuffle, "seed": seed, "epoch": epoch,
                   "drop_last": drop_last},
        "num_samples": sampler.num_samples,
        "total_size": sampler.total_size,
        "indices": list(sampler),
    }


def cases():
    # Every size against every replica count, at the first and last rank (and a middle
    # one for 8): once in order, once shuffled with seed, epoch and drop_last cycling.
    step = 0
    for n in SIZES:
        for num_replicas in REPLICAS:
            ranks = sorted({0, num_replicas - 1} | ({3} if num_replicas == 8 else set()))
            for rank in ranks:
                yield record(n, num_replicas, rank, False, 0, 0, step % 2 == 1)
                yield record(n, num_replicas, rank, True, SEEDS[step % 3],
                             EPOCHS[(step // 3) % 3], step % 2 == 0)
                step += 1
    # Every seed x epoch x drop_last at one point, so each pairing appears at least once.
    for seed in SEEDS:
        for epoch in EPOCHS:
            for drop_last in (False, True):
                yield record(17, 3, 1, True, seed, epoch, drop_last)
    # Every rank of small datasets, including more replicas than samples, where padding
    # repeats the dataset several times and drop_last leaves nothing.
    for n in [1, 2, 7, 10, 11, 17]:
        for num_replicas in [3, 4, 8]:
            for rank in range(num_replicas):
                for drop_last in (False, True):
                    yield record(n, num_replicas, rank, True, 42, 1, drop_last)


WEIGHTS = [
    [1.0, 2.0, 3.0, 4.0],
    [0.5, 0.0, 0.25, 3.0, 1.0, 0.0, 2.0],
    [0.1 * (i % 7) + 0.05 for i in range(23)],
]


def record_weighted(weights, num_samples, replacement, seed, epoch):
    # What WeightedRandomSampler yields in an epoch whose generator was seeded seed + epoch:
    # paratrain's WeightedSampler with one replica must yield the same.
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    sampler = WeightedRandomSampler(weights, num_samples, replacement=replacement, generator=generator)
    return {
        "params": {"weights": weights, "num_samples": num_samples, "replacement": replacement,
                   "seed": seed, "epoch": epoch},
        "indices": list(sampler),
    }


def weighted_cases():
    for w, weights in enumerate(WEIGHTS):
        positive = sum(1 for x in weights if x > 0)
        for num_samples in sorted({1, positive, 2 * len(weights)}):
            for replacement in (True, False):
                if not replacement and num_samples > positive:
                    continue
                for seed, epoch in ((0, 0), (42, 3), (7 + w, 1)):
                    yield record_weighted(weights, num_samples, replacement, seed, epoch)


def main():
    # One file per PyTorch major version (tests/support/sampler_reference.hpp picks the one
    # matching the LibTorch under test): 2.x draws one weighted sample differently.
    major = int(torch.__version__.split(".")[0])
    out = pathlib.Path(__file__).with_name("sampler_reference.json" if major < 2 else
                                           f"sampler_reference_torch{major}.json")
    all_cases = list(cases())
    weighted = list(weighted_cases())
    # One case a line keeps the file small and its diffs readable.
    lines = [json.dumps(c, sort_keys=True, separators=(",", ":")) for c in all_cases]
    weighted_lines = [json.dumps(c, sort_keys=True, separators=(",", ":")) for c in weighted]
    header = json.dumps({"generator": "tests/data/make_sampler_reference.py",
                         "torch": torch.__version__}, sort_keys=True, separators=(",", ":"))
    text = ('{"about":' + header + ',\n"cases":[\n' + ",\n".join(lines) + "\n],\n"
            '"weighted":[\n' + ",\n".join(weighted_lines) + "\n]}\n")
    out.write_text(text)
    print(f"wrote {len(all_cases)} cases to {out}")


if __name__ == "__main__":
    main()

#!/usr/bin/python3
"""Compares two weights files as benchmarks/tensor_parallel_vs_dtensor.py --weights-out writes
them (float32 little-endian, concatenated; FILE.json: [{"name", "shape"}, ...] in that order).

Matches the tensors by name and prints one JSON line: max_relative_difference, the largest over
the tensors of max|a - b| / max|b| (max|a - b| where b is all zeros), with the tensor it
comes from, and the count of tensors. Exit code 1 when the names or shapes differ (or a file's
size is not its index's). Standard library only (no numpy): runs on either side of
scripts/peer-root.sh.

  python3 benchmarks/compare_weights.py A B
"""
import argparse
import array
import json
import math
import sys


def load(path):
    """{name: (shape, floats)} of one weights file."""
    with open(path + ".json") as f:
        index = json.load(f)
    data = array.array("f")
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) % 4:
        raise SystemExit(f"compare_weights: {path}: {len(raw)} bytes, not whole float32s")
    data.frombytes(raw)
    if sys.byteorder != "little":
        data.byteswap()
    tensors, at = {}, 0
    for entry in index:
        n = math.prod(entry["shape"])
        tensors[entry["name"]] = (list(entry["shape"]), data[at:at + n])
        at += n
    if at != len(data):
        print(f"compare_weights: {path} holds {len(data)} floats, its index {at}", file=sys.stderr)
        sys.exit(1)
    return tensors


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a")
    p.add_argument("b", help="the reference (the denominator's)")
    args = p.parse_args()
    a, b = load(args.a), load(args.b)
    if list(a) != list(b) and sorted(a) != sorted(b):
        print(json.dumps({"error": "names differ", "only_in_a": sorted(set(a) - set(b)),
                          "only_in_b": sorted(set(b) - set(a))}))
        sys.exit(1)
    shapes = [n for n in b if a[n][0] != b[n][0]]
    if shapes:
        print(json.dumps({"error": "shapes differ", "tensors": {n: [a[n][0], b[n][0]] for n in shapes}}))
        sys.exit(1)
    worst, where = 0.0, None
    for name, (_, ref) in b.items():
        diff = max((abs(x - y) for x, y in zip(a[name][1], ref)), default=0.0)
        scale = max((abs(y) for y in ref), default=0.0)
        rel = diff / scale if scale > 0 else diff
        if where is None or rel > worst:
            worst, where = rel, name
    print(json.dumps({"max_relative_difference": worst, "worst_tensor": where, "tensors": len(b),
                      "same_order": list(a) == list(b)}))


if __name__ == "__main__":
    main()

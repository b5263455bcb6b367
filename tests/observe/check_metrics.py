#!/usr/bin/env python3
"""Checks fit's metrics files (ObserveOptions::metrics_jsonl and metrics_csv): every
JSON Lines record parses, the CSV has a header and the same records with the same
values, epochs and steps are in order.

usage: check_metrics.py JSONL CSV --epochs E
"""
import argparse
import csv
import json
import math
import sys

from checks import fail, status


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("jsonl")
    parser.add_argument("csv")
    parser.add_argument("--epochs", type=int, required=True)
    args = parser.parse_args()

    records = [json.loads(line) for line in open(args.jsonl)]
    with open(args.csv, newline="") as f:
        rows = list(csv.DictReader(f))
    kinds = [r["kind"] for r in records]
    if kinds.count("epoch") != args.epochs:
        fail(f"{kinds.count('epoch')} epoch records, expected {args.epochs}")
    if "step" not in kinds:
        fail("no log-point record")
    steps = [r["step"] for r in records]
    if steps != sorted(steps):
        fail(f"steps out of order: {steps}")
    for r in records:
        names = {"train/loss", "train/lr"} if r["kind"] == "step" else {"epoch/train_loss", "epoch/eval_accuracy"}
        if not names <= r.keys():
            fail(f"record lacks {sorted(names - r.keys())}: {r}")
        if r["kind"] == "epoch" and not 0 <= r["epoch/eval_accuracy"] <= 1:
            fail(f"accuracy out of range: {r}")
    if len(rows) != len(records):
        fail(f"{len(rows)} CSV rows, {len(records)} JSON Lines records")
    for row, rec in zip(rows, records):
        for key, value in rec.items():
            cell = row.get(key)
            if cell is None:
                fail(f"CSV has no column {key}")
            elif key == "kind":
                if cell != value:
                    fail(f"kind {cell} != {value}")
            elif value is not None and not math.isclose(float(cell), value, rel_tol=0, abs_tol=0):
                fail(f"{key}: CSV {cell} != JSON {value}")
        extra = {k for k, v in row.items() if v != "" and k not in rec}
        if extra:
            fail(f"CSV row has values JSON Lines lacks: {sorted(extra)}")
    print(f"{args.jsonl}, {args.csv}: {len(records)} records agree")
    return status()


if __name__ == "__main__":
    sys.exit(main())

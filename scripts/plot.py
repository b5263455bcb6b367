#!/usr/bin/env python3
"""Plots what fit's observe options wrote (docs/observability.md shows the results).

  loss.png        the loss at each log point (JSON Lines) and each epoch's train/eval loss
  step_time.png   every rank's step time, step by step (trace)
  phases.png      every rank's mean time per phase and per step (trace)

usage: scripts/plot.py --jsonl metrics.jsonl --trace trace.json [--out docs/plots]

Needs matplotlib: Debian's python3-matplotlib (PARATRAIN_WITH_DOCS=1 scripts/deps.sh
installs it) with Debian's /usr/bin/python3, or `pip install matplotlib`.
"""
import argparse
import collections
import json
import os
import statistics

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

PHASES = ["data", "forward", "backward", "sync", "optimizer"]


def plot_loss(jsonl, out):
    records = [json.loads(line) for line in open(jsonl)]
    steps = [r for r in records if r["kind"] == "step" and r.get("train/loss") is not None]
    epochs = [r for r in records if r["kind"] == "epoch"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in steps], [r["train/loss"] for r in steps], label="train loss (log points)", lw=1)
    ax.plot([r["step"] for r in epochs], [r["epoch/train_loss"] for r in epochs], "o-", label="train loss (epoch)")
    if any("epoch/eval_loss" in r for r in epochs):
        ax.plot([r["step"] for r in epochs], [r["epoch/eval_loss"] for r in epochs], "s-", label="eval loss (epoch)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (mean over all ranks' samples)")
    ax.set_title("Loss, from metrics.jsonl")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "loss.png"), dpi=110)
    plt.close(fig)


def plot_trace(trace_file, out):
    events = [e for e in json.load(open(trace_file))["traceEvents"] if e["ph"] == "X"]
    ranks = sorted({e["pid"] for e in events})

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in ranks:
        steps = sorted((e["args"]["step"], e["dur"] / 1e3) for e in events if e["pid"] == r and e["name"] == "step")
        ax.plot([s for s, _ in steps], [d for _, d in steps], lw=1, label=f"rank {r}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("step time (ms)")
    ax.set_title("Step time per rank, from trace.json")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "step_time.png"), dpi=110)
    plt.close(fig)

    # Mean time per step in each phase; the step's remainder is fit's own bookkeeping.
    fig, ax = plt.subplots(figsize=(7, 4))
    bottoms = [0.0] * len(ranks)
    for phase in PHASES + ["other"]:
        heights = []
        for i, r in enumerate(ranks):
            mine = [e for e in events if e["pid"] == r]
            n = max(1, sum(e["name"] == "step" for e in mine))
            if phase == "other":
                total = sum(e["dur"] for e in mine if e["name"] == "step")
                heights.append(max(0.0, total / n / 1e3 - bottoms[i]))
            else:
                heights.append(sum(e["dur"] for e in mine if e["name"] == phase) / n / 1e3)
        ax.bar([f"rank {r}" for r in ranks], heights, bottom=bottoms, label=phase)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    comm = collections.defaultdict(list)
    for e in events:
        if e["name"].startswith("all_reduce"):
            comm[e["pid"]].append(e["dur"] / 1e3)
    ax.set_ylabel("mean time per step (ms)")
    ax.set_title("Where each rank's step goes (sync = waiting for gradients)\n" + ", ".join(
        f"rank {r}: all-reduce median {statistics.median(comm[r]):.2f} ms" for r in ranks if comm[r]), fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "phases.png"), dpi=110)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jsonl")
    parser.add_argument("--trace")
    parser.add_argument("--out", default="docs/plots")
    args = parser.parse_args()
    if not args.jsonl and not args.trace:
        parser.error("give --jsonl, --trace or both")
    os.makedirs(args.out, exist_ok=True)
    if args.jsonl:
        plot_loss(args.jsonl, args.out)
    if args.trace:
        plot_trace(args.trace, args.out)
    print(f"plots written to {args.out}")


if __name__ == "__main__":
    main()

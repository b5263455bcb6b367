#!/usr/bin/env python3
"""Draws the docs' pictures from recorded data (scripts/pictures.sh records the cheap data
and calls this; each picture's caption in docs/ names the command).

  from DATA/pipeline_schedules.json  (docs/pipeline_tables.cpp --json)
    pipeline_gpipe.png, pipeline_1f1b.png,     each schedule of docs/pipeline.md as a Gantt
    pipeline_interleaved_1f1b.png,             chart: rank on y, time on x, one box per
    pipeline_zb_h1.png                         action labelled by micro-batch
  from DATA/ddp_trace.json           (fit's trace_file: transformer_ddp --trace)
    ddp_step.png                      one DDP step per rank: phases and bucket all-reduces
  from DATA/memory.json              (bench_zero --breakdown per ZeRO stage)
    memory_by_stage.png               rank 0's tensors' peak, process peak and plan::peak
  from DATA/scaling.json             (transcribed from docs/benchmarks.md)
    scaling.png                       steps/s per world size, paratrain and PyTorch DDP

usage: scripts/pictures.py --data docs/pictures/data --out docs/pictures

A missing data file is skipped with a note (at least one must be there). Needs matplotlib:
Debian's python3-matplotlib (PARATRAIN_WITH_DOCS=1 scripts/deps.sh installs it) with
Debian's /usr/bin/python3, or `pip install matplotlib`.
"""
import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import to_rgb  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

# One colour per kind of work, the same in every picture.
COLOUR = {
    "forward": "#4c78a8",
    "backward": "#f58518",
    "backward_input": "#e45756",
    "backward_weight": "#54a24b",
    "data": "#b0b0b0",
    "sync": "#e45756",
    "optimizer": "#72b7b2",
    "all_reduce": "#9d755d",
}
LETTER = {"forward": "F", "backward": "B", "backward_input": "b", "backward_weight": "w"}
DPI = 110


def lighter(colour, amount=0.45):
    """`colour` mixed with white: a rank's second model chunk."""
    return tuple(c + (1 - c) * amount for c in to_rgb(colour))


def save(fig, out, name):
    path = os.path.join(out, name)
    # No timestamp in the file, so that an unchanged picture is an unchanged file.
    fig.savefig(path, dpi=DPI, metadata={"Software": None}, bbox_inches="tight", pad_inches=0.08)
    plt.close(fig)
    print(f"  {path}")


# ---- pipeline schedules ----------------------------------------------------------------


def draw_pipelines(data, out):
    doc = json.load(open(data))
    ranks, micro = doc["ranks"], doc["micro_batches"]
    costs = doc["costs"]
    # One time axis for all four, so their lengths compare at a glance.
    longest = max(s["makespan"] for s in doc["schedules"])
    for s in doc["schedules"]:
        fig, ax = plt.subplots(figsize=(10, 0.45 * ranks + 1.6))
        used = set()
        for r, actions in enumerate(s["actions"]):
            for a in actions:
                colour = COLOUR[a["op"]]
                if a["chunk"] > 0:
                    colour = lighter(colour)
                used.add((a["op"], a["chunk"]))
                width = a["end"] - a["start"]
                ax.barh(r, width, left=a["start"], height=0.8, color=colour, edgecolor="white", linewidth=0.6)
                label = str(a["micro"]) + (f".{a['chunk']}" if s["virtual_stages"] > 1 else "")
                ax.text(a["start"] + width / 2, r, label, ha="center", va="center",
                        fontsize=6.5 if len(label) > 2 else 7.5, color="white" if a["chunk"] == 0 else "black")
        ax.set_xlim(0, longest)
        ax.set_ylim(ranks - 0.5, -0.5)  # rank 0 on top
        ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
        ax.set_xlabel(f"time (forward {costs['forward']:g}, backward_input {costs['backward_input']:g}, "
                      f"backward_weight {costs['backward_weight']:g}; no communication time)", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(axis="x", alpha=0.25)
        ax.set_axisbelow(True)
        bubble = s["bubble"][0] if len(set(round(b, 6) for b in s["bubble"])) == 1 else None
        title = (f"{s['name']}: {ranks} ranks, {micro} micro-batches"
                 + (f", {s['virtual_stages']} chunks per rank" if s["virtual_stages"] > 1 else "")
                 + f"; length {s['makespan']:g}, bubble "
                 + (f"{bubble:.3f}" if bubble is not None else ", ".join(f"{b:.3f}" for b in s["bubble"]))
                 + ", peak activations per rank " + ", ".join(str(n) for n in s["peak_alive"]))
        ax.set_title(title, fontsize=9, loc="left")
        names = {"forward": "forward", "backward": "backward (whole)", "backward_input": "backward_input (B)",
                 "backward_weight": "backward_weight (W)"}
        handles = []
        for op in ("forward", "backward", "backward_input", "backward_weight"):
            for chunk in (0, 1):
                if (op, chunk) in used:
                    colour = COLOUR[op] if chunk == 0 else lighter(COLOUR[op])
                    text = names[op] + (f", chunk {chunk}" if s["virtual_stages"] > 1 else "")
                    handles.append(Patch(color=colour, label=text))
        ax.legend(handles=handles, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.24), ncol=len(handles),
                  frameon=False)
        fig.tight_layout()
        save(fig, out, s["picture"] + ".png")


# ---- one DDP step, from fit's trace ----------------------------------------------------

PHASES = ["data", "forward", "backward", "sync", "optimizer"]


def step_length(events, origin):
    """From `origin` to the end of the last step event, µs."""
    return max(e["ts"] + e["dur"] for e in events if e["name"] == "step") - origin


def draw_ddp_step(data, out):
    events = [e for e in json.load(open(data))["traceEvents"] if e["ph"] == "X"]
    ranks = sorted({e["pid"] for e in events})
    # The last step every rank finished: warm, and on every rank.
    step = min(max(e["args"]["step"] for e in events if e["pid"] == r and e["name"] == "step") for r in ranks)
    mine = [e for e in events if e["args"]["step"] == step]
    origin = min(e["ts"] for e in mine if e["name"] == "step")
    ms = lambda us: us / 1e3  # noqa: E731

    # Per rank two rows: the phases, and the bucket all-reduces, whose lanes (the trace's
    # tids 1, 2, ...: all-reduces that overlap each other) split the row's height.
    rows = []  # (label, events, lanes)
    for r in ranks:
        phases = [e for e in mine if e["pid"] == r and e["tid"] == 0 and e["name"] != "step"]
        rows.append((f"rank {r}\nphases", phases, 1))
        lanes = max([e["tid"] for e in mine if e["pid"] == r], default=0)
        rows.append((f"rank {r}\nall-reduces", [e for e in mine if e["pid"] == r and e["tid"] > 0], max(1, lanes)))
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(rows) + 1.9))
    buckets = 0
    for y, (_, evs, lanes) in enumerate(rows):
        for e in evs:
            start, width = ms(e["ts"] - origin), ms(e["dur"])
            if e["name"].startswith("all_reduce bucket"):
                index = int(e["name"].rsplit(" ", 1)[1])
                buckets = max(buckets, index + 1)
                height = 0.7 / lanes
                centre = y - 0.35 + height * (e["tid"] - 0.5)
                ax.barh(centre, width, left=start, height=height, color=COLOUR["all_reduce"], edgecolor="white",
                        linewidth=0.6)
                if width > 0.012 * ms(step_length(mine, origin)):
                    ax.text(start + width / 2, centre, str(index), ha="center", va="center", fontsize=7, color="white")
            else:
                ax.barh(y, width, left=start, height=0.7, color=COLOUR[e["name"]], edgecolor="white", linewidth=0.6)
                if width > 0.05 * ms(step_length(mine, origin)):
                    ax.text(start + width / 2, y, e["name"], ha="center", va="center", fontsize=8, color="white")
    ax.set_xlim(0, ms(step_length(mine, origin)) * 1.01)
    ax.set_yticks(range(len(rows)), [label for label, _, _ in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.tick_params(labelsize=8)
    ax.set_xlabel(f"ms from the start of step {step} (rank 0's clock; every rank's clock aligned to it)", fontsize=8)
    ax.grid(axis="x", alpha=0.25)
    ax.set_axisbelow(True)
    waits = []
    for r in ranks:
        sync = [e for e in mine if e["pid"] == r and e["name"] == "sync"]
        backward = [e for e in mine if e["pid"] == r and e["name"] == "backward"]
        if sync and backward:
            waits.append(f"rank {r}: backward {ms(backward[0]['dur']):.0f} ms, sync {ms(sync[0]['dur']):.1f} ms")
    ax.set_title(f"One DDP step, {len(ranks)} ranks: {buckets} bucket all-reduces (numbered in launch order) run while"
                 f" backward computes; sync is what is left to wait for\n" + "; ".join(waits), fontsize=9, loc="left")
    handles = [Patch(color=COLOUR[p], label=p) for p in PHASES] + [
        Patch(color=COLOUR["all_reduce"], label="bucket all-reduce (launch to completion seen)")]
    ax.legend(handles=handles, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=6, frameon=False)
    fig.tight_layout()
    save(fig, out, "ddp_step.png")


# ---- memory per ZeRO stage -------------------------------------------------------------


def draw_memory(data, out):
    doc = json.load(open(data))
    runs = doc["runs"]
    order = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}
    runs.sort(key=lambda r: order.get(r["strategy"], 9))
    names = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3"}
    bars = [("plan::peak (predicted)", "plan_peak_mib", "#bab0ac"),
            ("tensors' peak (counted at the allocator)", "r0_tensors_peak_mib", "#4c78a8"),
            ("process peak (VmHWM)", "r0_peak_above_baseline_mib", "#f58518")]
    fig, ax = plt.subplots(figsize=(8, 4.6))
    width = 0.26
    xs = range(len(runs))
    for i, (label, key, colour) in enumerate(bars):
        heights = [r[key] for r in runs]
        positions = [x + (i - 1) * width for x in xs]
        ax.bar(positions, heights, width, label=label, color=colour)
        for p, h in zip(positions, heights):
            ax.text(p, h + 4, f"{h:.0f}", ha="center", va="bottom", fontsize=7)
    for x, r in zip(xs, runs):  # the model state the strategy holds between steps
        ax.hlines(r["held_mib"], x - 1.5 * width, x + 1.5 * width, colors="black", linestyles="dashed", linewidth=1)
    ax.plot([], [], color="black", linestyle="dashed", linewidth=1, label="model state held (params, grads, Adam)")
    ax.set_xticks(list(xs), [names.get(r["strategy"], r["strategy"]) for r in runs])
    ax.set_ylabel("MiB above the process's baseline, rank 0")
    first = runs[0]
    ax.set_title(f"Memory per rank by stage: {first['parameters'] / 1e6:.1f}M-parameter MLP, Adam, "
                 f"{first['ranks']} ranks, batch {first['batch_per_rank']} per rank", fontsize=9, loc="left")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2, frameon=False)
    ax.set_ylim(0, max(r["r0_peak_above_baseline_mib"] for r in runs) * 1.12)
    ax.grid(axis="y", alpha=0.25)
    ax.set_axisbelow(True)
    fig.tight_layout()
    save(fig, out, "memory_by_stage.png")


# ---- scaling against PyTorch DDP -------------------------------------------------------


def draw_scaling(data, out):
    doc = json.load(open(data))
    rows = doc["rows"]
    sides = []
    for r in rows:
        if r["implementation"] not in sides:
            sides.append(r["implementation"])
    colours = ["#f58518", "#4c78a8"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.8), gridspec_kw={"width_ratios": [3, 2]})
    for side, colour, below in zip(sides, colours, (True, False)):
        mine = sorted((r for r in rows if r["implementation"] == side), key=lambda r: r["ranks"])
        ws = [r["ranks"] for r in mine]
        left.plot(ws, [r["steps_per_s"] for r in mine], "o-", color=colour, label=side)
        left.plot(ws, [r["no_comm_steps_per_s"] for r in mine], "o--", color=colour, alpha=0.5,
                  label=side.split(" (")[0].replace(" DataParallel", "") + ": the same step, no communication")
        for w, r in zip(ws, mine):
            left.annotate(f"{r['steps_per_s']:g}", (w, r["steps_per_s"]), textcoords="offset points",
                          xytext=(6, -10 if below else 4),
                          fontsize=7)
    world = sorted({r["ranks"] for r in rows})
    left.set_xticks(world)
    left.set_xlim(world[0] - 0.3, world[-1] + 0.4)
    left.set_ylim(0, max(r["no_comm_steps_per_s"] for r in rows) * 1.3)
    left.set_xlabel("ranks (one per core)")
    left.set_ylabel("optimizer steps/s (each rank a batch of 64)")
    left.legend(fontsize=7, loc="lower left")
    left.grid(alpha=0.25)
    # paratrain / PyTorch at each world size.
    by = {(r["implementation"], r["ranks"]): r["steps_per_s"] for r in rows}
    ratios = [by[(sides[1], w)] / by[(sides[0], w)] for w in world]
    right.bar([str(w) for w in world], ratios, color=colours[1], width=0.5)
    for i, q in enumerate(ratios):
        right.text(i, q + 0.03, f"{q:.2f}×", ha="center", va="bottom", fontsize=8)
    right.axhline(1, color="black", linewidth=0.8)
    right.set_ylim(0, max(ratios) * 1.25)
    right.set_xlabel("ranks")
    right.set_ylabel("paratrain / PyTorch steps/s")
    right.grid(axis="y", alpha=0.25)
    right.set_axisbelow(True)
    fig.suptitle("DDP against PyTorch DDP: MLP 784-1024-1024-10, Adam, one thread per rank "
                 "(docs/benchmarks.md, \"DDP vs PyTorch DDP\")", fontsize=9)
    fig.tight_layout()
    save(fig, out, "scaling.png")


DRAWINGS = [
    ("pipeline_schedules.json", draw_pipelines),
    ("ddp_trace.json", draw_ddp_step),
    ("memory.json", draw_memory),
    ("scaling.json", draw_scaling),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="docs/pictures/data", help="the recorded data (default: %(default)s)")
    parser.add_argument("--out", default="docs/pictures", help="where the pictures go (default: %(default)s)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    plt.rcParams["svg.hashsalt"] = "paratrain"  # unused for PNG; keeps an SVG run repeatable
    drawn = 0
    for name, draw in DRAWINGS:
        path = os.path.join(args.data, name)
        if not os.path.exists(path):
            print(f"pictures: no {path}; its picture is not drawn", file=sys.stderr)
            continue
        print(f"pictures: from {path}")
        draw(path, args.out)
        drawn += 1
    if drawn == 0:
        sys.exit(f"pictures: none of {', '.join(n for n, _ in DRAWINGS)} is in {args.data}")


if __name__ == "__main__":
    main()

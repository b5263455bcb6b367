#!/usr/bin/env python3
"""Checks the Chrome trace written by fit (ObserveOptions::trace_file).

- it loads with the json module and has "traceEvents";
- every rank 0..N-1 appears as a pid, with the same number of "step" events;
- each step's phases (data, forward, backward, sync, optimizer) are on tid 0, and every
  bucket all-reduce on a tid >= 1;
- complete ("X") events on one (pid, tid) nest or follow each other, never overlap partially;
- the clocks are aligned: a step's "sync" ends with an all-reduce that every rank leaves
  at nearly the same time, so its end must agree across ranks (median over steps).

usage: check_trace.py TRACE.json --ranks N [--max-skew-us US]
"""
import argparse
import collections
import json
import statistics
import sys

from checks import fail, status

PHASES = {"data", "forward", "backward", "sync", "optimizer"}
EPS = 2e-3  # ts and dur are written to 1 ns


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("trace")
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--max-skew-us", type=float, default=5000.0)
    args = parser.parse_args()

    with open(args.trace) as f:
        trace = json.load(f)
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    pids = {e["pid"] for e in events}
    if pids != set(range(args.ranks)):
        fail(f"pids {sorted(pids)}, expected 0..{args.ranks - 1}")
    named = {e["pid"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    if named != set(range(args.ranks)):
        fail(f"process_name metadata for {sorted(named)}")
    if len(trace.get("otherData", {}).get("clock_offset_us", [])) != args.ranks:
        fail("otherData.clock_offset_us does not have one offset per rank")

    steps = collections.Counter(e["pid"] for e in events if e["name"] == "step")
    if len(set(steps.values())) != 1 or not steps:
        fail(f"step events per rank differ: {dict(steps)}")
    for e in events:
        for key in ("name", "ts", "dur", "pid", "tid"):
            if key not in e:
                fail(f"event without {key}: {e}")
        if e["dur"] < 0:
            fail(f"negative duration: {e}")
        bucket = e["name"].startswith("all_reduce bucket ")
        if bucket != (e["tid"] >= 1):
            fail(f"{e['name']} on tid {e['tid']}")
        if not bucket and e["name"] not in PHASES | {"step"}:
            fail(f"unexpected event {e['name']}")
    for pid in pids:
        names = {e["name"] for e in events if e["pid"] == pid}
        if not PHASES <= names:
            fail(f"rank {pid} lacks phases {sorted(PHASES - names)}")
        if not any(n.startswith("all_reduce bucket ") for n in names):
            fail(f"rank {pid} has no bucket all-reduce")

    lanes = collections.defaultdict(list)
    for e in events:
        lanes[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    for key, spans in lanes.items():
        spans.sort(key=lambda s: (s[0], -s[1]))
        open_ = []
        for begin, end, name in spans:
            while open_ and open_[-1][0] <= begin + EPS:
                open_.pop()
            if open_ and end > open_[-1][0] + EPS:
                fail(f"pid {key[0]} tid {key[1]}: {name} [{begin}, {end}] overlaps {open_[-1][1]} partially")
            open_.append((end, name))

    sync_end = collections.defaultdict(dict)
    for e in events:
        if e["name"] == "sync":
            sync_end[e["args"]["step"]][e["pid"]] = e["ts"] + e["dur"]
    skews = [max(v.values()) - min(v.values()) for v in sync_end.values() if len(v) == args.ranks]
    if skews:
        skew = statistics.median(skews)
        print(f"median skew of the ranks' sync ends: {skew:.1f} us over {len(skews)} steps")
        if skew > args.max_skew_us:
            fail(f"ranks' clocks look misaligned: sync ends differ by {skew:.0f} us (median)")
    print(f"{args.trace}: {len(events)} events from ranks {sorted(pids)}, {max(steps.values(), default=0)} steps each")
    return status()


if __name__ == "__main__":
    sys.exit(main())

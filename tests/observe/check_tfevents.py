#!/usr/bin/env python3
"""Checks TensorBoard event files written by paratrain::observe::TensorBoardWriter.

For every record: the framing (uint64 length, masked CRC-32C of the length, data,
masked CRC-32C of the data) with a CRC-32C written here from its definition; then the
payload is decoded by Debian's protoc (`protoc --decode_raw`), independently of our
encoder. The first event must carry file_version "brain.Event:2", the others scalars
with the expected tags; with --jsonl, each scalar event must hold exactly the values of
the matching JSON Lines record (as float32, TensorBoard's simple_value).

Standard library only. Exit status 77 (ctest: skipped) when protoc is missing.

usage: check_tfevents.py DIR --ranks N [--protoc PATH] [--jsonl FILE]
"""
import argparse
import json
import os
import re
import shutil
import struct
import subprocess
import sys

from checks import fail, status

ROOT_TAGS = {"train/loss", "train/lr", "train/samples_per_second", "epoch/train_loss",
             "epoch/eval_loss", "epoch/eval_accuracy", "epoch/seconds", "epoch/samples_per_second"}
# write_logs.cpp also logs its own metric, "custom", through StepInfo::metrics; fit
# reduces those once per epoch.
ROOT_TAGS |= {"epoch/custom"}
RANK_TAGS = {"rank/step_seconds", "rank/wait_seconds", "rank/loss"}


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def masked(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def records(path):
    data = open(path, "rb").read()
    at, out = 0, []
    while at < len(data):
        if at + 12 > len(data):
            fail(f"{path}: truncated header at byte {at}")
            break
        length_bytes = data[at:at + 8]
        (length,) = struct.unpack("<Q", length_bytes)
        (length_crc,) = struct.unpack("<I", data[at + 8:at + 12])
        if length_crc != masked(length_bytes):
            fail(f"{path}: record {len(out)}: length CRC {length_crc:#x} != {masked(length_bytes):#x}")
        payload = data[at + 12:at + 12 + length]
        if at + 16 + length > len(data):
            fail(f"{path}: record {len(out)} truncated")
            break
        (data_crc,) = struct.unpack("<I", data[at + 12 + length:at + 16 + length])
        if data_crc != masked(payload):
            fail(f"{path}: record {len(out)}: data CRC {data_crc:#x} != {masked(payload):#x}")
        out.append(payload)
        at += 16 + length
    return out


def decode_raw(protoc, payload):
    run = subprocess.run([protoc, "--decode_raw"], input=payload, capture_output=True)
    if run.returncode != 0:
        fail(f"protoc --decode_raw failed: {run.stderr.decode(errors='replace')}")
        return ""
    return run.stdout.decode()


def parse_text(text):
    """protoc's text output as nested dicts: {field: [value or dict, ...]}."""
    stack = [{}]
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        if line.endswith("{"):
            child = {}
            stack[-1].setdefault(line[:-1].strip(), []).append(child)
            stack.append(child)
        elif line == "}":
            stack.pop()
        else:
            key, value = line.split(":", 1)
            stack[-1].setdefault(key.strip(), []).append(value.strip())
    return stack[0]


def as_float32(value):
    if value.startswith("0x"):
        return struct.unpack("<f", struct.pack("<I", int(value, 16)))[0]
    return float(value)


def unquote(value):
    return value[1:-1].encode().decode("unicode_escape") if value.startswith('"') else value


def check_file(path, protoc, expected_tags):
    events = []
    payloads = records(path)
    if len(payloads) < 2:
        fail(f"{path}: {len(payloads)} records; expected the file version and at least one scalar event")
        return events
    for i, payload in enumerate(payloads):
        text = decode_raw(protoc, payload)
        msg = parse_text(text)
        if "1" not in msg or not msg["1"][0].startswith("0x"):
            fail(f"{path}: record {i}: no wall_time (field 1, fixed64): {text!r}")
        if i == 0:
            if msg.get("3") != ['"brain.Event:2"']:
                fail(f"{path}: first record is not file_version \"brain.Event:2\": {text!r}")
            continue
        step = int(msg.get("2", ["0"])[0])
        values = {}
        for summary in msg.get("5", []):
            for value in summary.get("1", []):
                values[unquote(value["1"][0])] = as_float32(value["2"][0])
        if not values:
            fail(f"{path}: record {i} has no summary values: {text!r}")
        events.append((step, values))
    tags = set().union(*(v.keys() for _, v in events))
    if not expected_tags <= tags:
        fail(f"{path}: tags {sorted(tags)} lack {sorted(expected_tags - tags)}")
    steps = [s for s, _ in events]
    if steps != sorted(steps):
        fail(f"{path}: steps are not in order: {steps}")
    print(f"{path}: {len(payloads)} records, CRCs and protoc decoding ok, tags {sorted(tags)}")
    return events


def event_files(directory):
    return sorted(os.path.join(directory, f) for f in os.listdir(directory)
                  if "tfevents" in f and os.path.isfile(os.path.join(directory, f)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--protoc", default="protoc")
    parser.add_argument("--jsonl")
    args = parser.parse_args()

    assert crc32c(b"123456789") == 0xE3069283, "the checker's own CRC-32C is wrong"
    protoc = shutil.which(args.protoc)
    if protoc is None:
        print(f"SKIP: {args.protoc} not found; install protobuf-compiler (scripts/deps.sh does)")
        return 77

    root = event_files(args.dir)
    if len(root) != 1:
        fail(f"{args.dir}: expected exactly one event file (rank 0's), found {root}")
    else:
        events = check_file(root[0], protoc, ROOT_TAGS)
        if args.jsonl:
            lines = [json.loads(l) for l in open(args.jsonl)]
            if len(lines) != len(events):
                fail(f"{len(events)} scalar events but {len(lines)} JSON Lines records")
            for (step, values), record in zip(events, lines):
                want = {k: v for k, v in record.items() if k not in ("kind", "epoch", "step", "time")}
                if step != record["step"]:
                    fail(f"event step {step} != JSON Lines step {record['step']}")
                if set(values) != set(want):
                    fail(f"step {step}: event tags {sorted(values)} != JSON Lines names {sorted(want)}")
                for k in set(values) & set(want):
                    if want[k] is not None and values[k] != struct.unpack("<f", struct.pack("<f", want[k]))[0]:
                        fail(f"step {step}: {k} = {values[k]} in the event file, {want[k]} in JSON Lines")
            print(f"{len(events)} scalar events match {args.jsonl}")
    for r in range(args.ranks):
        sub = os.path.join(args.dir, f"rank{r}")
        files = event_files(sub) if os.path.isdir(sub) else []
        if len(files) != 1:
            fail(f"{sub}: expected one event file, found {files}")
            continue
        if not re.search(rf"\.{r}$", files[0]):
            fail(f"{files[0]}: the name does not end with the rank {r}")
        check_file(files[0], protoc, RANK_TAGS)
    return status()


if __name__ == "__main__":
    sys.exit(main())

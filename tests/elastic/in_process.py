#!/usr/bin/python3
"""Ranks lost and recovered from without a restart (paratrain::elastic::fit).

usage: in_process.py PROGRAM DATA_DIR [--seed N] [--shard-group G] [--events kill,stop] [--epochs 8]

PROGRAM is examples/elastic/train.cpp's binary, run with --recover in deterministic mode by
four processes started here (RANK, WORLD_SIZE, a fresh PARATRAIN_STORE_FILE; each in its own
session). A random moment after a checkpoint past a random step (so that the survivors' state
is some steps newer than the checkpoint), the test, by process id, never by name:
  kill   SIGKILLs a random rank: the others must go on at one rank fewer, from the state they
         hold ("from the survivors' state" in the new rank 0's line);
  stop   SIGSTOPs a random rank (hung, not dead): the others' waits give up after
         PARATRAIN_TIMEOUT (3 s) and they go on without it; once they have ended, it is woken
         (SIGCONT) and must end at once with status 1, saying it was left out;
  join   starts a new rank (as a launcher restarts a lost one): the job must let it in at its
         next checkpoint and go on at one rank more, every rank from that checkpoint.
The ranks must all end with status 0, at 4 minus the ranks lost plus those joined, with the final
parameters' bytes equal to those of one process trained without interruption (deterministic
mode: the same bits at every world size), and no process may be left.
--shard-group G trains ZeRO-3 sharded over groups of G ranks and replicated across them: a
lost rank's shard is restored from its replica.
Prints the time from each event to the survivors' new generation.
"""
import argparse
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import checkpoints, environment, same_bytes, uninterrupted  # noqa: E402

COMMON = ["--train-samples", "2400", "--global-batch", "48", "--batch", "48",
          "--deterministic-shards", "12", "--checkpoint-every", "10"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("program")
    ap.add_argument("data")
    ap.add_argument("--seed", type=int, default=int(time.time()))
    ap.add_argument("--shard-group", type=int, default=0)
    ap.add_argument("--events", default="kill,stop")
    ap.add_argument("--epochs", type=int, default=8, help="of 50 steps")
    ap.add_argument("--deadline", type=float, default=200)
    a = ap.parse_args()
    events = a.events.split(",")
    rng = random.Random(a.seed)
    common = COMMON + ["--epochs", str(a.epochs)]
    print(f"in_process: seed {a.seed}, events {events}, shard group {a.shard_group}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="paratrain-in-process-"))
    env = environment(GLOO_SOCKET_IFNAME="lo", PARATRAIN_TIMEOUT="3")
    passed = False
    ranks = []  # Popen, in rank order of generation 0
    logs = []
    try:
        failed = uninterrupted(a.program, a.data, work, common, env, a.deadline)
        if failed:
            print(failed)
            return 1
        ckpt = work / "ckpt"
        args = [a.program, "--data", a.data, "--recover", "--checkpoint-dir", str(ckpt),
                "--save-parameters", str(work / "elastic.bin"), "--shard-group", str(a.shard_group)] + common
        for r in range(4):
            logs.append(open(work / f"rank{r}.log", "w"))
            ranks.append(subprocess.Popen(args, env=dict(env, RANK=str(r), WORLD_SIZE="4",
                                                         PARATRAIN_STORE_FILE=str(work / "store")),
                                          stdout=logs[r], stderr=subprocess.STDOUT, start_new_session=True))
        start = time.monotonic()

        def text():
            return "".join((work / f"rank{r}.log").read_text(errors="replace") for r in range(len(ranks)))

        def wait_for(what, ready):
            while not ready():
                if time.monotonic() - start > a.deadline:
                    raise RuntimeError(f"{what}: not within the deadline")
                if all(ranks[r].poll() is not None for r in alive):  # a stopped one never ends
                    raise RuntimeError(f"{what}: every rank ended first")
                time.sleep(0.02)

        alive = [0, 1, 2, 3]
        stopped = None
        step = 0
        for generation, what in enumerate(events, start=1):
            past = step + rng.randrange(10, 30)
            wait_for(f"a checkpoint after step {past}", lambda: (checkpoints(ckpt) or [0])[-1] > past)
            step = checkpoints(ckpt)[-1]
            time.sleep(rng.uniform(0.02, 0.3))  # a step takes 10-40 ms here: a few steps later
            hit = time.monotonic()
            if what == "join":
                r = len(ranks)
                logs.append(open(work / f"rank{r}.log", "w"))
                ranks.append(subprocess.Popen(args, env=dict(env, RANK="0", WORLD_SIZE="1",
                                                             PARATRAIN_STORE_FILE=str(work / "store")),
                                              stdout=logs[r], stderr=subprocess.STDOUT, start_new_session=True))
                alive.append(r)
                print(f"in_process: start rank {r} after checkpoint {step}", flush=True)
                # "generation 3: 3 ranks go on with 1 joined (2 before), from the checkpoint of step 130"
                said = r"(\d+) ranks go on with (\d+) joined.*from ([^(]*)"
                expected = "one of them joined"
                right = lambda m: int(m.group(2)) == 1  # noqa: E731
            else:
                victim = alive.pop(rng.randrange(len(alive)))
                os.kill(ranks[victim].pid, signal.SIGKILL if what == "kill" else signal.SIGSTOP)
                stopped = victim if what == "stop" else stopped
                print(f"in_process: {what} rank {victim} of generation 0 after checkpoint {step}", flush=True)
                # "generation 1: 3 of 4 ranks go on, from the survivors' state at step 21 (...)"
                said = r"(\d+) of (\d+) ranks go on, from ([^(]*)"
                expected = "from the survivors' state"
                right = lambda m: "survivors' state" in m.group(3)  # noqa: E731
            line = re.compile(rf"generation {generation}: " + said)
            wait_for(f"generation {generation}", lambda: line.search(text()))
            m = line.search(text())
            print(f"in_process:   generation {generation} ({m.group(1)} ranks) {time.monotonic() - hit:.1f} s "
                  f"later, from {m.group(3).strip()}", flush=True)
            if int(m.group(1)) != len(alive) or not right(m):
                print(f"in_process: FAIL: expected {len(alive)} ranks to go on, {expected}")
                return 1
            step = max([step] + checkpoints(ckpt))  # the next event comes after what they resumed from
        for r in alive:
            ranks[r].wait(timeout=max(1, a.deadline - (time.monotonic() - start)))
        failed = [r for r in alive if ranks[r].returncode != 0]
        if failed:
            for r in failed:
                print(f"== rank {r}: status {ranks[r].returncode}")
                print((work / f"rank{r}.log").read_text(errors="replace")[-4000:])
            return 1
        print(f"in_process: the {len(alive)} survivors ended with status 0 after {time.monotonic() - start:.1f} s",
              flush=True)
        if stopped is not None:
            os.kill(ranks[stopped].pid, signal.SIGCONT)
            try:
                status = ranks[stopped].wait(timeout=30)
            except subprocess.TimeoutExpired:
                print("in_process: FAIL: the woken rank did not end within 30 s")
                return 1
            said = (work / f"rank{stopped}.log").read_text(errors="replace")
            if status != 1 or "left out" not in said:
                print(f"in_process: FAIL: the woken rank ended with status {status}, not 1 saying it was left out:")
                print(said[-2000:])
                return 1
            print("in_process: the woken rank ended with status 1: " + said.strip().splitlines()[-1], flush=True)
        ends = [line for line in text().splitlines() if "steps in all" in line]
        print("in_process: " + (ends[-1] if ends else "(no summary line)"), flush=True)
        if len(ends) != 1 or f"{len(alive)} rank(s)" not in ends[0]:
            print(f"in_process: FAIL: the job did not end at {len(alive)} ranks")
            return 1
        passed = same_bytes(work, "in_process")
        return 0 if passed else 1
    finally:
        if not passed:  # every rank's last lines, whatever failed
            for r in range(len(ranks)):
                tail = (work / f"rank{r}.log").read_text(errors="replace").splitlines(True)[-15:]
                print(f"== rank {r} (the last lines of its log):\n" + "".join(tail))
        for p in ranks:  # nothing may outlive the test: by process group, each rank its own
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        for log in logs:
            log.close()
        subprocess.run(["rm", "-rf", str(work)])


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/python3
"""An elastic job under torchrun's elastic agent that loses ranks and gets them back.

usage: torchrun_kills.py PROGRAM DATA_DIR [--seed N]

PROGRAM is examples/elastic/train.cpp's binary. Four agents ("nodes" of one worker each,
--nnodes 2:4, rendezvous c10d) train it in deterministic mode; at checkpoints past random
steps the test kills, each with SIGKILL by process id or process group, never by name:
  1. a random agent with its worker (a lost node): 4 -> 3 ranks,
  2. another: 3 -> 2,
  3. (two new agents join: back to 4)
  4. a random worker is stopped (SIGSTOP: hung, not dead): the others' watchdog names it and
     ends them, its agent ends it; the job goes on at 4,
  5. the worker of rank 0 is killed,
and the job must finish at 4 ranks, with every surviving agent's status 0, the stopped worker
gone, no process left, and the final parameters' bytes equal to those of one process trained
without interruption (deterministic mode: the same bits at every world size).
With --quick: one node lost (4 -> 3), one added (3 -> 4), rank 0's worker killed.
With --nondeterministic: without deterministic mode, where the world size changes how a global
batch's gradient is summed: the final parameters must be within 1e-5 of the uninterrupted run's
(one process: the single-device computation on the same global batches).
Prints the time from each kill to the next checkpoint written after it.
"""
import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import checkpoints, close_to, environment, same_bytes, uninterrupted  # noqa: E402

COMMON = ["--train-samples", "12000", "--global-batch", "48", "--batch", "48", "--epochs", "2",
          "--checkpoint-every", "4"]
DETERMINISTIC = ["--deterministic-shards", "12"]


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid):
    """Process ids whose parent is `pid` (from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(entry.name))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("program")
    ap.add_argument("data")
    ap.add_argument("--seed", type=int, default=int(time.time()))
    ap.add_argument("--deadline", type=float, default=270)
    ap.add_argument("--quick", action="store_true",
                    help="one node lost, one added, rank 0's worker killed (about 40 s instead of 110)")
    ap.add_argument("--nondeterministic", action="store_true",
                    help="without deterministic mode: the result within 1e-5 of the uninterrupted run's")
    a = ap.parse_args()
    common = COMMON if a.nondeterministic else COMMON + DETERMINISTIC
    rng = random.Random(a.seed)
    print(f"torchrun_kills: seed {a.seed}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="paratrain-elastic-"))
    env = environment(PARATRAIN_TIMEOUT="8")
    agents = []  # (Popen, log file)
    try:
        # The uninterrupted run: one process.
        failed = uninterrupted(a.program, a.data, work, common, env, a.deadline)
        if failed:
            print(failed)
            return 1
        port = free_port()
        ckpt = work / "ckpt"

        def start_agent(n):
            log = open(work / f"agent{n}.log", "w")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2:4", "--nproc_per_node", "1",
                   "--max_restarts", "10", "--monitor_interval", "1", "--redirects", "2", "--tee", "1",
                   "--log_dir", str(work / f"logs{n}"), "--rdzv_backend", "c10d",
                   "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "elastic",
                   "--rdzv_conf", "last_call_timeout=1", "--no_python", a.program, "--data", a.data,
                   "--checkpoint-dir", str(ckpt), "--save-parameters", str(work / "elastic.bin")] + common
            agents.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True), log))

        start = time.monotonic()

        def wait_for_checkpoint(past):
            """Waits for a complete checkpoint after step `past`; returns its step."""
            while time.monotonic() - start < a.deadline:
                done = checkpoints(ckpt)
                if done and done[-1] > past:
                    return done[-1]
                if all(p.poll() is not None for p, _ in agents):
                    raise RuntimeError("every agent ended before a checkpoint after step %d" % past)
                time.sleep(0.05)
            raise RuntimeError("no checkpoint after step %d within the deadline" % past)

        start_agent(0)
        time.sleep(1)  # agent 0 serves the rendezvous (at the endpoint): started first, never killed
        for n in (1, 2, 3):
            start_agent(n)
        step = wait_for_checkpoint(rng.randrange(4, 16))
        alive = [1, 2, 3]
        stopped = None
        events = (("lose a node", "add a node", "kill rank 0's worker") if a.quick else
                  ("lose a node", "lose a node", "add two nodes", "hang a rank", "kill rank 0's worker"))
        for what in events:
            killed = time.monotonic()
            if what == "lose a node":
                victim = alive.pop(rng.randrange(len(alive)))
                os.killpg(agents[victim][0].pid, signal.SIGKILL)
                agents[victim][0].wait()
            elif what.startswith("add"):
                for _ in range(2 if what == "add two nodes" else 1):
                    alive.append(len(agents))
                    start_agent(len(agents))
                # Grown once every agent has a worker again (they start them after the round).
                while not all(children(agents[n][0].pid) for n in [0] + alive):
                    if time.monotonic() - start > a.deadline:
                        raise RuntimeError("the new agents were not admitted within the deadline")
                    time.sleep(0.05)
                done = checkpoints(ckpt)
                step = max(step, done[-1] if done else step)
            elif what == "hang a rank":
                # SIGSTOP: alive but silent. The others' watchdog names it and ends them; its
                # agent, seeing the others wait for it, ends it (SIGTERM, then SIGKILL).
                stopped = children(agents[rng.choice(alive)][0].pid)[0]
                os.kill(stopped, signal.SIGSTOP)
            else:
                for pid in children(agents[0][0].pid):
                    os.kill(pid, signal.SIGKILL)
            print(f"torchrun_kills: {what}" + (" (admitted)" if what.startswith("add") else "") +
                  f" after checkpoint {step}", flush=True)
            step = wait_for_checkpoint(step + rng.randrange(0, 12))
            print(f"torchrun_kills:   checkpoint {step} written {time.monotonic() - killed:.1f} s later", flush=True)
        for p, _ in agents:
            if p.returncode is None or p.returncode == 0:
                p.wait(timeout=max(1, a.deadline - (time.monotonic() - start)))
        lost = [n for n in range(len(agents)) if n != 0 and n not in alive]
        failed = [n for n in [0] + alive if agents[n][0].returncode != 0]
        if failed:
            for n in failed:
                print(f"== agent {n}: status {agents[n][0].returncode}")
                print((work / f"agent{n}.log").read_text()[-4000:])
            return 1
        print(f"torchrun_kills: agents {lost} lost; the others ended with status 0 after "
              f"{time.monotonic() - start:.1f} s", flush=True)
        named = [f for f in work.rglob("stderr.log") if "watchdog on rank" in f.read_text(errors="replace")]
        if stopped is not None and not named:
            print("torchrun_kills: FAIL: no rank's watchdog named the stopped rank")
            return 1
        if stopped is not None and Path(f"/proc/{stopped}").exists():
            print(f"torchrun_kills: FAIL: the stopped worker {stopped} is still there")
            return 1
        # The last start ran at 4 ranks: the new agents joined (rank 0's line, in its agent's log).
        ends = [line for n in range(len(agents)) for line in (work / f"agent{n}.log").read_text().splitlines()
                if "steps in all" in line]
        print("torchrun_kills: the last start: " + (ends[-1] if ends else "(no summary line)"), flush=True)
        if len(ends) != 1 or "4 rank(s)" not in ends[0]:
            print("torchrun_kills: FAIL: the job did not end at 4 ranks")
            return 1
        if a.nondeterministic:
            return 0 if close_to(work, "torchrun_kills", 1e-5) else 1
        return 0 if same_bytes(work, "torchrun_kills") else 1
    except RuntimeError as e:
        print(f"torchrun_kills: FAIL: {e}")
        for n in range(len(agents)):
            print(f"== agent {n}: status {agents[n][0].poll()}")
            print((work / f"agent{n}.log").read_text(errors="replace")[-3000:])
        return 1
    finally:
        for p, log in agents:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            log.close()
        for p, _ in agents:  # nothing of a session may outlive the test (a worker the agent left)
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        subprocess.run(["rm", "-rf", str(work)])


if __name__ == "__main__":
    sys.exit(main())

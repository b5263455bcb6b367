#!/usr/bin/python3
"""What a lost rank costs (issue #39), by restart and without one: the time from a SIGKILL of
one rank to the next completed step, and the steps trained again.

usage: elastic_restart.py BUILD_DIR [--rounds 3] [--every 50]

Five runs, each trained with a checkpoint every --every steps (in the background):
- the Transformer example over MPI (transformer_ddp, 2 ranks): rank 1 is killed a random
  number of steps after a checkpoint; the watchdog or Open MPI ends the job, and the same
  mpirun command starts it again, resuming from the newest checkpoint;
- the Fashion-MNIST demo over Gloo (fashion_mnist_ddp_gloo, 2 ranks) under torchrun's agent
  (one node, --max_restarts 1), which restarts both workers itself;
- the elastic example (elastic_train --recover, an MLP on Fashion-MNIST over Gloo, 2 ranks
  meeting in a store file; again with --hidden 4096, a state the Transformer's size) and the
  Transformer example's model under elastic::fit over Gloo (bench_elastic_transformer): rank 1
  is killed and rank 0 goes on alone, in-process, from the state it holds; its first step
  after its "ranks go on" line counts.
A step is completed when its line appears (the Transformer's "step N/M" lines; the demo's
progress bar, PARATRAIN_PROGRESS=bar, redrawn after a step at most every 0.1 s). Kill -> next step includes the job's end,
the new processes' start (LibTorch's load), the meeting, the load of the checkpoint, and
the first step. Lost steps: those after the checkpoint resumed from, trained again.
"""
import argparse
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def children(pid):
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except OSError:
                pass
    return out


def descendants(pid):
    out, todo = [], [pid]
    while todo:
        for c in children(todo.pop()):
            out.append(c)
            todo.append(c)
    return out


class Watch:
    """Reads a process's output line by line, noting when each step line arrives."""

    def __init__(self, proc, pattern):
        self.proc, self.pattern, self.steps, self.lines = proc, re.compile(pattern), [], []
        self.regrouped = []  # when elastic::fit's survivors said they go on
        self.thread = threading.Thread(target=self.read, daemon=True)
        self.thread.start()

    def read(self):
        buf = b""
        while True:
            chunk = self.proc.stdout.read1(4096) if hasattr(self.proc.stdout, "read1") else self.proc.stdout.read(1)
            if not chunk:
                break
            buf += chunk
            while True:
                cut = min([i for i in (buf.find(b"\n"), buf.find(b"\r")) if i >= 0], default=-1)
                if cut < 0:
                    break
                line, buf = buf[:cut].decode(errors="replace"), buf[cut + 1:]
                self.lines.append(line)
                if "ranks go on" in line:
                    self.regrouped.append(time.monotonic())
                m = self.pattern.search(line)
                if m:
                    self.steps.append((time.monotonic(), int(m.group(1))))


def run_round(cmd, pattern, every, rng, env, kill_one, relaunch, in_process=False):
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    w = Watch(proc, pattern)
    target = every + rng.randrange(5, every - 5)
    while not w.steps or w.steps[-1][1] < target:
        if proc.poll() is not None:
            raise RuntimeError("the job ended before step %d:\n%s" % (target, "\n".join(w.lines[-20:])))
        time.sleep(0.005)
    killed_after = w.steps[-1][1]
    kill_one(proc)
    killed = time.monotonic()
    if relaunch:
        proc.wait()
        w.thread.join()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        w = Watch(proc, pattern)
        seen = 0
    else:
        seen = len(w.steps)
    # Under torchrun the surviving worker may still report a step it finished before the
    # kill: the restarted workers' first step is the one at or below the step killed after
    # (they resume from the checkpoint before it).
    def restarted():
        if in_process:  # the survivor's steps once it has gone on
            return [(at, step) for at, step in w.steps[seen:] if w.regrouped and at > w.regrouped[0]]
        return [(at, step) for at, step in w.steps[seen:] if relaunch or step <= killed_after]

    while not restarted():
        if proc.poll() is not None:
            w.thread.join()
            if restarted():
                break
            raise RuntimeError("no step after the kill:\n" + "\n".join(w.lines[-30:]))
        time.sleep(0.002)
    first_at, first_step = restarted()[0]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    # The first step after the restart is checkpoint + 1: the steps after it up to the kill
    # are trained again. In-process, the survivors go on from the step they completed: none
    # but the one in flight (the progress bar, redrawn at most every 0.1 s, may show an
    # earlier step than the last before the kill: never below 0).
    return first_at - killed, max(0, killed_after - (first_step - 1))


def in_process_name(name):
    return name.startswith(("elastic_train", "bench_elastic"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, OMP_NUM_THREADS="1", PARATRAIN_TIMEOUT="10",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    rows = []
    # The elastic example twice: the demo's MLP (101,770 parameters), and one as large as the
    # Transformer's state (--hidden 4096: 3.26M parameters; the Transformer runs over MPI, which
    # cannot recover in-process).
    # And the Transformer's own model under elastic::fit (bench_elastic_transformer).
    for name in ("transformer_ddp", "fashion_mnist_ddp_gloo", "elastic_train", "elastic_train --hidden 4096",
                 "bench_elastic_transformer"):
        program = Path(a.build) / ("benchmarks" if name.startswith("bench_") else "examples") / name.split()[0]
        if not program.exists():
            sys.exit(f"{program} is missing; build it: cmake --build {a.build} --target {name}")
        times, lost = [], []
        for r in range(a.rounds):
            work = Path(tempfile.mkdtemp(prefix="paratrain-restart-"))
            try:
                if name == "transformer_ddp":
                    cmd = [str(root / "scripts/mpirun.sh"), "2", str(program), "--d-model", "256", "--heads", "4",
                           "--layers", "2", "--ff", "1024", "--batch", "16", "--samples", "64000",
                           "--max-steps", "100000", "--workers", "1", "--checkpoint-dir", str(work / "ckpt"),
                           "--checkpoint-every", str(a.every)]
                    pattern = r"^step (\d+)/"

                    def kill_one(proc):  # rank 1: the second rank process under mpirun
                        ranks = [p for p in descendants(proc.pid)
                                 if Path(f"/proc/{p}/exe").exists() and
                                 os.path.basename(os.readlink(f"/proc/{p}/exe")) == "transformer_ddp"]
                        os.kill(sorted(ranks)[-1], signal.SIGKILL)
                    relaunch = True
                elif in_process_name(name):
                    store = work / "store"
                    launch = ["/bin/bash", "-c", "for r in 0 1; do RANK=$r WORLD_SIZE=2 \"$@\" & done; wait", "ranks",
                              str(program), "--checkpoint-dir", str(work / "ckpt"), "--checkpoint-every", str(a.every)]
                    if name.startswith("elastic_train"):
                        cmd = launch + ["--recover", "--epochs", "100", "--train-samples", "60000", "--global-batch",
                                       "128", "--batch", "64"] + name.split()[1:]
                        pattern = r"\] (\d+)/\d+"
                    else:  # the Transformer example's sizes above, 2 ranks of 16 samples
                        cmd = launch + ["--d-model", "256", "--heads", "4", "--ff", "1024", "--global-batch", "32"]
                        pattern = r"^step (\d+)/"

                    def kill_one(proc, exe=program.name):  # rank 1, the second one started
                        ranks = [p for p in children(proc.pid) if os.path.basename(os.readlink(f"/proc/{p}/exe")) == exe]
                        os.kill(sorted(ranks)[-1], signal.SIGKILL)
                    relaunch = False
                else:
                    with socket.socket() as s:
                        s.bind(("127.0.0.1", 0))
                        port = s.getsockname()[1]
                    cmd = ["/usr/bin/python3", "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--max_restarts", "1", "--monitor_interval", "0.2", "--master_addr", "127.0.0.1",
                           "--master_port", str(port), "--redirects", "2", "--tee", "1",
                           "--log_dir", str(work / "logs"), "--no_python", str(program),
                           "--epochs", "100", "--batch", "64", "--workers", "1",
                           "--checkpoint-dir", str(work / "ckpt"), "--checkpoint-every", str(a.every)]
                    pattern = r"\] (\d+)/\d+"  # the progress bar's "step/steps" (PARATRAIN_PROGRESS=bar)

                    def kill_one(proc):  # one worker of the agent
                        workers = children(proc.pid)
                        os.kill(sorted(workers)[-1], signal.SIGKILL)
                    relaunch = False
                in_process = in_process_name(name)
                round_env = dict(env, PARATRAIN_PROGRESS="bar") if not relaunch else env
                if in_process:
                    round_env = dict(round_env, PARATRAIN_STORE_FILE=str(store), GLOO_SOCKET_IFNAME="lo")
                seconds, steps = run_round(cmd, pattern, a.every, rng, round_env, kill_one, relaunch, in_process)
                times.append(seconds)
                lost.append(steps)
                print(f"{name} round {r + 1}: kill -> next step {seconds:.2f} s, {steps} steps trained again",
                      flush=True)
            finally:
                subprocess.run(["rm", "-rf", str(work)])
        rows.append((name, times, lost))
    print()
    print(f"| program | restart by | kill -> next completed step, s (median; min-max) | steps trained again (median) |")
    print("|---|---|---:|---:|")
    for name, times, lost in rows:
        by = "no restart: elastic::fit" if in_process_name(name) else {
            "transformer_ddp": "a new mpirun", "fashion_mnist_ddp_gloo": "torchrun's agent"}[name]
        print(f"| {name} | {by} | {statistics.median(times):.2f} ({min(times):.2f}-{max(times):.2f}) | "
              f"{statistics.median(lost):.0f} |")
    print()
    print(f"Command: {' '.join(sys.argv)} (2 ranks each, a checkpoint every {a.every} steps in the background, "
          f"PARATRAIN_TIMEOUT=10, one intra-op thread per rank)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the elastic tests share (torchrun_kills.py, in_process.py): the checkpoints on disk, the
environment without a launcher's variables, the uninterrupted run, and its parameters compared
(byte for byte, or within a tolerance)."""
import array
import os
import subprocess
from pathlib import Path

LAUNCHER = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "PARATRAIN_STORE_FILE", "TORCHELASTIC_USE_AGENT_STORE")


def checkpoints(directory):
    """Steps of the complete checkpoints (with an index) in `directory`."""
    out = []
    if directory.is_dir():
        for p in directory.iterdir():
            if p.name.startswith("step-") and (p / "index.pt").exists():
                out.append(int(p.name[5:]))
    return sorted(out)


def environment(**settings):
    """This process's environment without a launcher's variables, with `settings`."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **settings)
    for k in LAUNCHER:
        env.pop(k, None)
    return env


def uninterrupted(program, data, work, common, env, deadline):
    """Trains `program` as one process without interruption; its parameters go to work/ref.bin.
    Returns None, or the failed run's output."""
    ref = subprocess.run([program, "--data", data, "--checkpoint-dir", str(work / "ref"),
                          "--save-parameters", str(work / "ref.bin")] + common,
                         env=env, capture_output=True, text=True, timeout=deadline)
    return None if ref.returncode == 0 else ref.stdout + ref.stderr


def same_bytes(work, who):
    """Whether work/elastic.bin equals work/ref.bin, byte for byte; says which, as `who`."""
    got, want = (work / "elastic.bin").read_bytes(), (work / "ref.bin").read_bytes()
    if got != want:
        print(f"{who}: FAIL: the final parameters differ from the uninterrupted run's ({len(got)} and {len(want)} bytes)")
        return False
    print(f"{who}: the final parameters equal the uninterrupted run's, byte for byte ({len(got)} bytes)")
    return True


def close_to(work, who, tolerance):
    """Whether work/elastic.bin's float32 parameters are each within `tolerance` of work/ref.bin's;
    says which, with the largest difference, as `who`."""
    got, want = array.array("f"), array.array("f")
    got.frombytes((work / "elastic.bin").read_bytes())
    want.frombytes((work / "ref.bin").read_bytes())
    if len(got) != len(want) or not got:
        print(f"{who}: FAIL: {len(got)} parameters against the uninterrupted run's {len(want)}")
        return False
    worst = max(abs(a - b) for a, b in zip(got, want))
    if not worst <= tolerance:
        print(f"{who}: FAIL: the final parameters differ from the uninterrupted run's by up to {worst:.3g} "
              f"(tolerance {tolerance:g})")
        return False
    print(f"{who}: the final parameters are within {worst:.3g} of the uninterrupted run's "
          f"({len(got)} float32, tolerance {tolerance:g})")
    return True

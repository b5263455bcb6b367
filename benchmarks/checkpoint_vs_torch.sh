#!/usr/bin/env bash
# Checkpoint save / load, paratrain beside PyTorch (torch.save / torch.load + fsync, as a
# DDP job's rank 0 writes), for the 16.8M- (4 layers) and 50.4M-parameter (12 layers)
# models of the ZeRO benchmark, at 1 and 2 ranks; prints a table with the ratios.
# Both sides run with the same glibc allocator settings:
#   MALLOC_MMAP_THRESHOLD_=67108864 MALLOC_TRIM_THRESHOLD_=2147483647
# (paratrain's own defaults, Note [Allocator]; stated for PyTorch too, so both are equal).
# Files go to $PARATRAIN_BENCH_DIR (default: build-bench/, on the same disk as the sources).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${PARATRAIN_BUILD_DIR:-build-bench}
dir=${PARATRAIN_BENCH_DIR:-$build}/checkpoint_bench.tmp
python=/usr/bin/python3
export MALLOC_MMAP_THRESHOLD_=67108864 MALLOC_TRIM_THRESHOLD_=2147483647 OMP_NUM_THREADS=1
out=$(mktemp)
trap 'rm -f "$out"' EXIT
for layers in 4 12; do
  $python benchmarks/checkpoint_vs_torch.py "$layers" "$dir" >>"$out"
  for ranks in 1 2; do
    for strategy in ddp zero3; do
      scripts/mpirun.sh "$ranks" "$build/benchmarks/bench_checkpoint" --strategy "$strategy" --layers "$layers" --dir "$dir" >>"$out"
    done
  done
done
$python - "$out" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
torch = {(r["parameters"], r["what"]): r for r in rows if r["implementation"] == "pytorch"}
# What each paratrain measurement is compared with: a training checkpoint with PyTorch's
# training state dicts, the whole-model file with the model's state dict.
peer = {("sharded save", "sync"): "training save", ("sharded save", "async"): "training save",
        ("sharded load", "sync"): "training load", ("full save", "sync"): "full save", ("full load", "sync"): "full load"}
print(f"{'params':>7} {'strategy':>8} {'ranks':>5} {'what':<13} {'mode':<5} {'MiB/rank':>8} {'seconds':>8} "
      f"{'blocked s':>9} {'torch s':>8} {'torch/ours (blocked)':>20}")
for r in rows:
    if r["implementation"] != "paratrain":
        continue
    t = torch[(r["parameters"], peer[(r["what"], r["mode"])])]
    print(f"{r['parameters'] / 1e6:6.1f}M {r['strategy']:>8} {r['ranks']:>5} {r['what']:<13} {r['mode']:<5} "
          f"{r['mib_per_rank']:8.1f} {r['seconds']:8.3f} {r['blocked_seconds']:9.3f} {t['seconds']:8.3f} "
          f"{t['seconds'] / r['blocked_seconds']:20.2f}")
PY

#!/usr/bin/env bash
# A change's cost on DDP, ZeRO and pipelines: the paratrain benchmarks of two checkouts
# (BEFORE and AFTER, e.g. `git worktree add ../before <rev>`), alternated round by round on
# this machine, each at its defaults (the allocator settings are the library's own, the same
# code on both sides: Note [Allocator]). Prints the medians and the after/before ratios.
# Build first, in each checkout: scripts/bench.sh builds into build-bench/ at -O3, or
#   PARATRAIN_BUILD_DIR=build-bench PARATRAIN_OPT=-O3 scripts/build.sh --target bench_ddp_vs_torch bench_zero bench_pipeline
# Usage: benchmarks/before_after.sh BEFORE AFTER [ROUNDS=5]
set -euo pipefail
[[ $# -ge 2 ]] || { sed -n 2,8p "$0" >&2; exit 2; }
before=$(realpath "$1") after=$(realpath "$2") rounds=${3:-5}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for ((r = 1; r <= rounds; ++r)); do
  for side in before after; do
    tree=${!side}
    cd "$tree"
    scripts/mpirun.sh 2 build-bench/benchmarks/bench_ddp_vs_torch --steps 200 2>/dev/null | grep steps_per_s | jq -r .steps_per_s >> "$out/ddp.$side"
    for s in zero1 zero3; do
      scripts/mpirun.sh 2 build-bench/benchmarks/bench_zero --strategy $s --layers 4 --steps 15 2>/dev/null | grep steps_per_s | jq -r .steps_per_s >> "$out/$s.$side"
    done
    # pipeline: the mean step time (ms) of 1F1B and ZB-H1 at M = 8 (columns: schedule, M, ..., step ms)
    scripts/mpirun.sh 2 build-bench/benchmarks/bench_pipeline --width 1024 --layers 4 --micro 64 --steps 7 2>/dev/null |
      awk -F'|' '$3+0 == 8 && ($2 ~ /1F1B|1f1b|ZB|zb/) && $2 !~ /nterleaved/ {s += $10; n++} END {print s / n}' >> "$out/pipeline_ms.$side"
  done
  echo "round $r done" >&2
done
med() { sort -g "$1" | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}'; }
printf '| benchmark | before (median of %d) | after | after / before |\n|---|---:|---:|---:|\n' "$rounds"
for b in ddp zero1 zero3 pipeline_ms; do
  B=$(med "$out/$b.before") A=$(med "$out/$b.after")
  awk -v b="$b" -v B="$B" -v A="$A" 'BEGIN { printf "| %s | %s | %s | %.3f |\n", b, B, A, A / B }'
done
for b in ddp zero1 zero3 pipeline_ms; do echo "$b before: $(tr '\n' ' ' < "$out/$b.before"); after: $(tr '\n' ' ' < "$out/$b.after")"; done

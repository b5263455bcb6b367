#!/usr/bin/env bash
# paratrain's DataParallel (DDP) and ZeRO stages 1-3 against PyTorch's DDP and
# ZeroRedundancyOptimizer, 2 ranks, same model, data and machine; one process per
# configuration (peak RSS is per configuration). Prints a markdown table with step
# rates, peak RSS, what paratrain holds for the model states and what paratrain::plan
# predicts. Builds nothing: build bench_zero first (scripts/bench.sh zero does both).
#
# Usage: benchmarks/zero_vs_torch.sh [layers, "4 12"] [timed steps, 30] [rounds, 1]
#
# Allocator (Note [Allocator] in include/paratrain/memory/allocator.hpp), stated per row:
#   - "defaults":  nothing in the environment. paratrain then sets glibc's mmap threshold
#                  to 64 MiB and trim threshold to 2 GiB itself; PyTorch keeps glibc's.
#   - "tuned":     MALLOC_MMAP_THRESHOLD_=67108864 MALLOC_TRIM_THRESHOLD_=2147483647 for
#                  the process: PyTorch at its best, and the very settings paratrain
#                  applies at its defaults, so paratrain's rows and PyTorch's tuned rows
#                  run under equal allocator settings.
set -euo pipefail
cd "$(dirname "$0")/.."
sizes=${1:-"4 12"}
steps=${2:-30}
rounds=${3:-1}
build=${PARATRAIN_BUILD_DIR:-build-bench}
python=/usr/bin/python3
. benchmarks/side_by_side.sh  # benchmark_setup, machine_line
benchmark_setup bench_zero
tuned=(MALLOC_MMAP_THRESHOLD_=67108864 MALLOC_TRIM_THRESHOLD_=2147483647)

record() {  # record ALLOCATOR COMMAND...: runs it, keeps its JSON line with the allocator named
  local alloc=$1
  shift
  echo "\$ $*" >&2
  "$@" | jq -c --arg alloc "$alloc" '. + {allocator: $alloc}' | tee -a "$tmp/results" >&2
}

for ((round = 1; round <= rounds; ++round)); do
  for layers in $sizes; do
    echo "-- round $round, $layers layers" >&2
    for mode in ddp zero1; do
      record defaults "$python" benchmarks/zero_vs_torch.py --mode $mode --layers "$layers" --steps "$steps"
      record tuned env "${tuned[@]}" "$python" benchmarks/zero_vs_torch.py --mode $mode --layers "$layers" --steps "$steps"
    done
    for strategy in ddp zero1 zero2 zero3; do
      record defaults scripts/mpirun.sh 2 "$bench" --strategy "$strategy" --layers "$layers" --steps "$steps"
    done
  done
done

jq -rs '
  def median: sort | .[length / 2 | floor];
  def f(d): . * pow(10; d) | round / pow(10; d) | tostring;
  group_by([.implementation, .strategy, .allocator, .layers]) | map(.[0] + {
    steps_per_s: (map(.steps_per_s) | median), peak_rss_mib: (map(.peak_rss_mib) | median), runs: length}) as $rows
  def torch_zero1_best(l): $rows | map(select(.implementation == "pytorch" and .strategy == "zero1" and .layers == l)) | max_by(.steps_per_s);
  def ours(s; l): $rows | map(select(.implementation == "paratrain" and .strategy == s and .layers == l)) | .[0];
  "| model | implementation | strategy | allocator | steps/s | × paratrain DDP | × PyTorch ZeRO-1 at its best | peak RSS/rank MiB | model states held MiB | planned MiB |",
  "|---|---|---|---|---:|---:|---:|---:|---:|---:|",
  ($rows | sort_by(.layers, .implementation != "pytorch", .strategy, .allocator)[] as $r
   | "| \($r.parameters / 1e6 | f(1))M | \($r.implementation) | \($r.strategy) | \($r.allocator) | \($r.steps_per_s | f(2))"
     + " | \(($r.steps_per_s / ours("ddp"; $r.layers).steps_per_s) | f(2))"
     + " | \(($r.steps_per_s / torch_zero1_best($r.layers).steps_per_s) | f(2))"
     + " | \($r.peak_rss_mib | f(0)) | \($r.held_mib // "—") | \($r.planned_mib // "—") |")
' "$tmp/results"
echo
echo "Command: $0 \"$sizes\" $steps $rounds (2 ranks, one per core; OMP_NUM_THREADS=1)"
machine_line

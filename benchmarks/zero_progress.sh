#!/usr/bin/env bash
# ZeRO's step rate against paratrain's DDP, with comm::Mpi's progress thread off and on
# (Note [Progress thread]): bench_zero (zero.hpp) for DDP and ZeRO 1-3, each configuration
# in `rounds` interleaved rounds (DDP, ZeRO-1, -2, -3, each with the thread off then on),
# so that the machine's drift hits both sides alike; prints the median steps/s, the ratios
# to DDP's (with the same setting) and the share of the step blocked on communication
# (exposed_communication_seconds: the gradients' wait and ZeRO's gathers) as a markdown table. Builds nothing: build
# bench_zero first (scripts/bench.sh zero_progress does both).
#
# Usage: benchmarks/zero_progress.sh [layers, "4 12"] [ranks, 2] [timed steps, 15] [rounds, 3] [interval µs, 200]
# Layers of Linear(2048, 2048): 4 are 16.8M parameters, 12 are 50.4M.
# Allocator: paratrain's defaults (Note [Allocator]) on both sides, nothing in the environment.
set -euo pipefail
cd "$(dirname "$0")/.."
sizes=${1:-"4 12"}
ranks=${2:-2}
steps=${3:-15}
rounds=${4:-3}
interval=${5:-200}
build=${PARATRAIN_BUILD_DIR:-build-bench}
python=/usr/bin/python3  # for machine_line
. benchmarks/side_by_side.sh  # benchmark_setup, machine_line
benchmark_setup bench_zero

for layers in $sizes; do
  for ((round = 1; round <= rounds; ++round)); do
    for strategy in ddp zero1 zero2 zero3; do
      for progress in 0 "$interval"; do
        echo "\$ PARATRAIN_MPI_PROGRESS_US=$progress scripts/mpirun.sh $ranks $bench --strategy $strategy --layers $layers --steps $steps --warmup 3" >&2
        PARATRAIN_MPI_PROGRESS_US=$progress scripts/mpirun.sh "$ranks" "$bench" --strategy "$strategy" --layers "$layers" \
          --steps "$steps" --warmup 3 |
          jq -c --argjson p "$progress" '. + {progress_us: $p}' | tee -a "$tmp/results" >&2
      done
    done
  done
done

jq -rs '
  def f(d): . * pow(10; d) | round / pow(10; d) | tostring;
  def median: sort | if length % 2 == 1 then .[length / 2 | floor] else (.[length / 2 - 1] + .[length / 2]) / 2 end;
  group_by([.layers, .strategy, .progress_us])
  | map({layers: .[0].layers, parameters: .[0].parameters, ranks: .[0].ranks, strategy: .[0].strategy,
         progress_us: .[0].progress_us, rate: (map(.steps_per_s) | median),
         exposed: (map(.exposed_comm_share) | median), runs: length})
  | . as $rows
  | def ddp(r): $rows | map(select(.strategy == "ddp" and .layers == r.layers and .progress_us == r.progress_us)) | .[0].rate;
  def with(r; p): $rows | map(select(.strategy == r.strategy and .layers == r.layers and .progress_us == p)) | .[0].rate;
  "| model | ranks | strategy | steps/s, thread off | × DDP | exposed | steps/s, thread on | × DDP | exposed | on / off |",
  "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
  ($rows | map(select(.progress_us == 0)) | sort_by(.layers, .strategy)[] as $r
   | ($rows | map(select(.strategy == $r.strategy and .layers == $r.layers and .progress_us != 0)) | .[0]) as $on
   | "| \($r.parameters / 1e6 | f(1))M | \($r.ranks) | \($r.strategy) | \($r.rate | f(2)) | \(($r.rate / ddp($r)) | f(2))"
     + " | \($r.exposed * 100 | f(1))% | \($on.rate | f(2)) | \(($on.rate / ddp($on)) | f(2)) | \($on.exposed * 100 | f(1))%"
     + " | \(($on.rate / $r.rate) | f(2)) |")
' "$tmp/results"
echo
echo "Command: $0 \"$sizes\" $ranks $steps $rounds $interval (one intra-op thread per rank; medians of $rounds runs)"
machine_line

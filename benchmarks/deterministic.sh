#!/usr/bin/env bash
# What deterministic mode costs (issue #26): bench_deterministic (deterministic.cpp) on 2
# ranks, DDP and ZeRO-2 with Adam, without deterministic mode and with 2 virtual shards (one
# per rank: the same forward and backward as without, the gradients all-gathered and added
# in order) and 12 (what covers 1-4 ranks: 6 forward and backward passes of a sixth of the
# batch per rank), on the wide MLPs (4 layers: 16.8M parameters, 12: 50.4M) and the
# Transformer example's model. Each round runs every configuration once, in order, so that
# the machine's drift hits all alike; the table gives the median ms/step and the ratio to
# the same strategy without deterministic mode. Builds nothing: build bench_deterministic
# first (scripts/bench.sh deterministic does both).
#
# Usage: benchmarks/deterministic.sh [rounds, 3] [timed steps, 9] [shards, "2 12"]
# Allocator: paratrain's defaults (Note [Allocator]) on both sides, nothing in the environment.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
steps=${2:-9}
shard_counts=${3:-"2 12"}
build=${PARATRAIN_BUILD_DIR:-build-bench}
python=/usr/bin/python3  # for machine_line
. benchmarks/side_by_side.sh  # benchmark_setup, machine_line
benchmark_setup bench_deterministic

models=("--model mlp --layers 4" "--model mlp --layers 12" "--model transformer --layers 2 --d-model 128 --batch 16")
for ((round = 1; round <= rounds; ++round)); do
  for model in "${models[@]}"; do
    for strategy in ddp zero2; do
      for shards in 0 $shard_counts; do
        # shellcheck disable=SC2086  # $model is several options
        echo "\$ scripts/mpirun.sh 2 $bench $model --strategy $strategy --shards $shards --steps $steps" >&2
        # shellcheck disable=SC2086
        scripts/mpirun.sh 2 "$bench" $model --strategy "$strategy" --shards "$shards" --steps "$steps" |
          tee -a "$tmp/results" >&2
      done
    done
  done
done

jq -rs -L benchmarks 'include "table";
  group_by([.model, .parameters, .strategy, .shards])
  | map(.[0] + {ms: (map(.ms_per_step) | median), runs: length})
  | . as $rows
  | def plain(r): $rows | map(select(.model == r.model and .parameters == r.parameters and .strategy == r.strategy
                                      and .shards == 0)) | .[0].ms;
  "| model | parameters | ranks | batch per rank | strategy | virtual shards | ms/step (median) | × without |",
  "|---|---:|---:|---:|---|---:|---:|---:|",
  ($rows | sort_by(.model, .parameters, .strategy, .shards)[] as $r
   | "| \($r.model) | \($r.parameters / 1e6 | f(1))M | \($r.ranks) | \($r.batch_per_rank) | \($r.strategy) | "
     + "\(if $r.shards == 0 then "off" else $r.shards | tostring end) | \($r.ms | f(1)) | \(($r.ms / plain($r)) | f(3)) |")
' "$tmp/results"
echo
echo "Command: benchmarks/deterministic.sh $rounds $steps \"$shard_counts\" (2 ranks, Adam, one intra-op thread per rank; medians of $rounds rounds)"
machine_line

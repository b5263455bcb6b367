#!/usr/bin/env bash
# What the loop's new per-step work costs (issue #25): the Transformer example on 2 ranks
# with fit's plain loop, against the same run with a time limit (one scalar all-reduce per
# step, so that every rank stops after the same step: Note [Ending before the time limit]),
# a warm-up + cosine schedule set before every step, and throughput counted. Rounds
# alternate the two; the table gives each round's ms/step (the slowest rank's mean after the
# warm-up steps) and the median ratio. A small model makes the per-step cost as visible as
# it can be; on a larger one it is a smaller share of a longer step. Builds nothing: build
# transformer_ddp first (scripts/bench.sh fit_loop does).
#
# Usage: benchmarks/fit_loop.sh [rounds, 5] [steps, 60] [d_model, 128]
# Allocator: paratrain's defaults (Note [Allocator]) for both; nothing in the environment.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-5}
steps=${2:-60}
width=${3:-128}
build=${PARATRAIN_BUILD_DIR:-build-bench}
python=/usr/bin/python3  # for machine_line
. benchmarks/side_by_side.sh  # require_built, run_clean, machine_line
require_built "$build" transformer_ddp
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

common=(--d-model "$width" --heads 4 --layers 2 --ff $((4 * width)) --batch 16 --samples $((steps * 32))
        --max-steps "$steps" --warmup 5 --workers 1)
for ((r = 0; r < rounds; ++r)); do
  run_clean scripts/mpirun.sh 2 "$build/examples/transformer_ddp" "${common[@]}"
  run_clean scripts/mpirun.sh 2 "$build/examples/transformer_ddp" "${common[@]}" --time-limit 36000 \
    --lr-schedule cosine --lr-warmup 5
done

jq -rs --argjson rounds "$rounds" '
  def median: sort | if length % 2 == 1 then .[length / 2 | floor] else (.[length / 2 - 1] + .[length / 2]) / 2 end;
  def f(d): . * pow(10; d) | round / pow(10; d) | tostring;
  [range(0; $rounds) as $i | {plain: .[2 * $i].ms_per_step, loop: .[2 * $i + 1].ms_per_step}] as $pairs
  | "| round | plain loop ms/step | time limit + cosine + throughput ms/step | ratio |",
    "|---:|---:|---:|---:|",
    ($pairs | to_entries[] | "| \(.key + 1) | \(.value.plain | f(2)) | \(.value.loop | f(2)) | \((.value.loop / .value.plain) | f(3)) |"),
    "| median | \($pairs | map(.plain) | median | f(2)) | \($pairs | map(.loop) | median | f(2)) | \($pairs | map(.loop / .plain) | median | f(3)) |"
' "$tmp/results"
echo
echo "Command: $0 $rounds $steps $width (2 ranks, batch 16 per rank, 2+2 layers, one intra-op thread per rank)"
machine_line

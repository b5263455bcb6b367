#!/usr/bin/env bash
# What frequent checkpoints cost (issue #39): the Transformer example on 2 ranks, trained
# without checkpoints and with one every N steps (fit's default: written in the background,
# the newest 2 kept), rounds alternating the two. A save happens between steps, so the cost
# shows in the run's wall time, not in its ms/step: the table gives each round's wall
# seconds, the extra seconds per checkpoint, and the extra time as a share of the run's steps
# (the issue's goal: at most 5% with a checkpoint every 50 steps). Builds nothing: build
# transformer_ddp first (scripts/bench.sh checkpoint_cost does).
#
# Usage: benchmarks/checkpoint_cost.sh [rounds, 3] [steps, 200] [every, 50] [d_model, 256]
# Allocator: paratrain's defaults (Note [Allocator]) for both; nothing in the environment.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
steps=${2:-200}
every=${3:-50}
width=${4:-256}
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
  rm -rf "$tmp/ckpt"
  run_clean scripts/mpirun.sh 2 "$build/examples/transformer_ddp" "${common[@]}" --checkpoint-dir "$tmp/ckpt" \
    --checkpoint-every "$every"
done

saves=$((steps / every))
jq -rs --argjson rounds "$rounds" --argjson saves "$saves" --argjson steps "$steps" '
  def median: sort | if length % 2 == 1 then .[length / 2 | floor] else (.[length / 2 - 1] + .[length / 2]) / 2 end;
  def f(d): . * pow(10; d) | round / pow(10; d) | tostring;
  [range(0; $rounds) as $i | {plain: .[2 * $i], saved: .[2 * $i + 1]}
   | {plain: .plain.wall_seconds, saved: .saved.wall_seconds, ms: .plain.ms_per_step}] as $pairs
  | "| round | no checkpoints: wall s | every \($steps / $saves) steps: wall s | s per checkpoint | share of the steps |",
    "|---:|---:|---:|---:|---:|",
    ($pairs | to_entries[] | "| \(.key + 1) | \(.value.plain | f(2)) | \(.value.saved | f(2)) | \(((.value.saved - .value.plain) / $saves) | f(3)) | \(((.value.saved - .value.plain) / (.value.ms * $steps / 1000) * 100) | f(2))% |"),
    "| median | \($pairs | map(.plain) | median | f(2)) | \($pairs | map(.saved) | median | f(2)) | \($pairs | map((.saved - .plain) / $saves) | median | f(3)) | \($pairs | map((.saved - .plain) / (.ms * $steps / 1000) * 100) | median | f(2))% |"
' "$tmp/results"
echo
echo "Command: $0 $rounds $steps $every $width (2 ranks, batch 16 per rank, 2+2 layers, one intra-op thread per rank)"
machine_line

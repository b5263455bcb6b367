#!/usr/bin/env bash
# The GPT example's mixture-of-experts variant (examples/gpt: each block's MLP a mixture of 8
# experts, top-2, capacity 1.25) at expert degrees 1, 2 and 4 on the same 4 ranks, side by
# side: ep = 1 (every expert on every rank: data parallelism alone) is the reference. Each
# row: the median step time (the slowest rank's, the first step left out) and its ratio to
# ep = 1, the bytes the expert group's all-to-alls sent a step, the gradient bytes a rank
# handed to collectives in the last step (its buckets': the experts' summed over their replicas,
# the dense parameters' over the expert group too), the parameters a rank holds, and the model
# state it keeps between steps beside the plan's: under DDP (gpt_ddp) and under ZeRO-3
# (gpt_zero3: the experts' state sharded over their replicas, the dense parameters' over the
# expert group too). The same samples a rank at every degree: the losses agree (ctest
# example.gpt_moe_losses_agree). 4 ranks share the machine's cores.
#
# Usage: benchmarks/moe.sh [steps, 12] [extra gpt_ddp options...]
# Allocator: paratrain's defaults (Note [Allocator]) on every side, nothing in the environment.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-12}
shift || true
build=${PARATRAIN_BUILD_DIR:-build-bench}
python=/usr/bin/python3  # for machine_line
. benchmarks/side_by_side.sh  # require_built, machine_line
require_built "$build" gpt_ddp
require_built "$build" gpt_zero3
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
model=(--experts 8 --top-k 2 --hidden 128 --heads 8 --ffn 512 --sequence 64 --vocabulary 256 --layers 2 --batch 32
       --dropout 0 --steps "$steps" "$@")
for strategy in ddp zero3; do
  for ep in 1 2 4; do
    cmd=(scripts/mpirun.sh 4 "$build/examples/gpt_$strategy" "${model[@]}" --expert-parallel "$ep")
    echo "\$ ${cmd[*]}" >&2
    "${cmd[@]}" | grep '^{"example"' | jq -c --arg s "$strategy" '. + {strategy: $s}' | tee -a "$tmp/results" >&2
  done
done
machine_line
echo "model: ${model[*]}"
jq -rs '
  def f(d): . * pow(10; d) | round / pow(10; d) | tostring;
  "| strategy | expert degree | step (ms) | ÷ ep 1 | all-to-all bytes/step | gradient bytes/step | parameters/rank | model state bytes/rank (planned) | final loss |",
  "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
  (group_by(.strategy) | sort_by(.[0].strategy) | .[] |
   (.[] | select(.expert_parallel == 1) | .step_ms) as $base
   | .[] | "| \(.strategy) | \(.expert_parallel) | \(.step_ms | f(1)) | \(.step_ms / $base | f(2)) | \(.all_to_all_bytes_per_step) | \(.gradient_bytes_per_step) | \(.parameters_per_rank) | \(.model_state_bytes) (\(.planned_state_bytes)) | \(.loss | f(6)) |")
' "$tmp/results"

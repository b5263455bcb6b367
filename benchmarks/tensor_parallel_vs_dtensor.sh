#!/usr/bin/env bash
# paratrain's tensor parallelism beside PyTorch 2.6's own (DTensor: parallelize_module with
# ColwiseParallel / RowwiseParallel, Gloo), on the same stack of pre-norm GPT blocks, the
# same data and the same machine, at tensor degree 2 (2 ranks, one per core), with and
# without sequence parallelism. Both sides run in the Debian 13 root of scripts/peer-root.sh
# (PyTorch and LibTorch 2.6, CPU): bench_tensor_parallel built there against LibTorch 2.6,
# benchmarks/tensor_parallel_vs_dtensor.py under its python3. Prints, per mode, both step
# times and the ratio torch / paratrain, both sides' final weights against each other
# (benchmarks/compare_weights.py: both start from the same seed's weights), and the bytes
# the tensor group moved per step beside Megatron's count.
#
# Usage: benchmarks/tensor_parallel_vs_dtensor.sh [steps, 20] [warm-up steps, 5] [rounds, 3]
#
# Both sides: one intra-op thread per rank, rank r pinned to core r, and the same glibc
# allocator settings, set here for both (paratrain's defaults, Note [Allocator]):
#   MALLOC_MMAP_THRESHOLD_=67108864 MALLOC_TRIM_THRESHOLD_=2147483647
# Each side's time is the slowest rank's mean step time over the timed steps; the rounds
# alternate the sides, and the best round of each is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-20}
warmup=${2:-5}
rounds=${3:-3}
if [[ ${PARATRAIN_INSIDE_PEER_ROOT:-} != 1 ]]; then
  scripts/peer-root.sh --prepare
  exec scripts/peer-root.sh env PARATRAIN_INSIDE_PEER_ROOT=1 benchmarks/tensor_parallel_vs_dtensor.sh \
    "$steps" "$warmup" "$rounds"
fi

build=/build/peer
mkdir -p /build
python=/usr/bin/python3
echo "paratrain: building bench_tensor_parallel against $(dpkg-query -W -f '${Package} ${Version}' libtorch-dev)" >&2
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPARATRAIN_WITH_GLOO=OFF >"$build.configure.log" 2>&1 ||
  { tail -40 "$build.configure.log"; exit 1; }
cmake --build "$build" --target bench_tensor_parallel >&2
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
export MALLOC_MMAP_THRESHOLD_=67108864 MALLOC_TRIM_THRESHOLD_=2147483647
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
shape=(--steps "$steps" --warmup "$warmup" --layers 4 --batch 8 --seq 64 --hidden 256 --heads 8 --ffn 1024)
for mode in plain sp; do
  flag=()
  [[ $mode == sp ]] && flag=(--sequence-parallel)
  for ((round = 1; round <= rounds; ++round)); do
    echo "-- $mode, round $round of $rounds" >&2
    mpirun -n 2 --bind-to core "$build/benchmarks/bench_tensor_parallel" "${shape[@]}" "${flag[@]}" \
      --weights-out "$tmp/paratrain-$mode" | tee -a "$tmp/paratrain.jsonl" >&2
    "$python" benchmarks/tensor_parallel_vs_dtensor.py --ranks 2 --bind "${shape[@]}" "${flag[@]}" \
      --weights-out "$tmp/torch-$mode" | tee -a "$tmp/torch.jsonl" >&2
  done
  "$python" benchmarks/compare_weights.py "$tmp/paratrain-$mode" "$tmp/torch-$mode" |
    jq -c --arg mode "$mode" '. + {mode: $mode}' >>"$tmp/weights.jsonl"
done

jq -rn --slurpfile ours "$tmp/paratrain.jsonl" --slurpfile torch "$tmp/torch.jsonl" \
  --slurpfile weights "$tmp/weights.jsonl" '
  def f(n): (n * 100 | round) / 100;
  def best(xs; sp): xs | map(select(.sequence_parallel == sp)) | min_by(.ms_per_step);
  "| mode | PyTorch DTensor ms/step | paratrain ms/step | ratio torch/paratrain | final weights, max relative difference | bytes per step (paratrain: all-reduce / all-gather / reduce-scatter) | Megatron'"'"'s count |",
  "|---|---:|---:|---:|---:|---|---:|",
  ([false, true][] as $sp
   | best($ours[0:]; $sp) as $o | best($torch[0:]; $sp) as $t
   | ($weights | map(select(.mode == (if $sp then "sp" else "plain" end)))[0]) as $w
   | (4 * $o.layers * $o.batch * $o.seq * $o.hidden * 4) as $megatron
   | "| \(if $sp then "tensor + sequence parallel" else "tensor parallel" end), t = \($o.tensor_parallel)"
     + " | \($t.ms_per_step | f(.)) | \($o.ms_per_step | f(.)) | \($t.ms_per_step / $o.ms_per_step | f(.))×"
     + " | \($w.max_relative_difference) | \($o.all_reduce_bytes_per_step) / \($o.all_gather_bytes_per_step) / \($o.reduce_scatter_bytes_per_step)"
     + " | \(if $sp then "\($megatron * 3 / 2) / \($megatron)" else "\($megatron)" end) |"),
  "",
  "Rounds (ms/step, paratrain | PyTorch): " + ([$ours[], $torch[]] | group_by(.implementation)
     | map(map("\(if .sequence_parallel then "sp" else "tp" end) \(.ms_per_step | f(.))") | join(", ")) | join(" | ")),
  "Megatron'"'"'s count: 4 collectives of b·s·h fp32 per block and step (2 forward, 2 backward): all-reduces, or with"
     + " sequence parallelism as many reduce-scatters and 6 all-gathers (4, and the 2 regions'"'"' inputs gathered again"
     + " backward: kept as shards); paratrain'"'"'s sequence-parallel all-reduces are the layer norms'"'"' and row-parallel"
     + " biases'"'"' gradients (and the loss)."'
echo
echo "Command: MALLOC_MMAP_THRESHOLD_=67108864 MALLOC_TRIM_THRESHOLD_=2147483647 benchmarks/tensor_parallel_vs_dtensor.sh $steps $warmup $rounds"
echo "Machine: $(env -u OMP_NUM_THREADS nproc) cores ($(lscpu | sed -n 's/^Model name: *//p')), inside $(. /etc/os-release && echo "$PRETTY_NAME"),\
 LibTorch $(dpkg-query -W -f '${Version}' libtorch-dev), PyTorch $("$python" -c 'import torch; print(torch.__version__)'),\
 $(mpirun --version | head -1)"

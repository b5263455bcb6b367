#!/usr/bin/env bash
# Reading the Transformer's data from HDF5, side by side: the Transformer example (torch.nn.Transformer's
# defaults, 44.1M parameters, DDP on 2 ranks, batch 32 per rank, Adam) trained from data in
# memory and from the same data in an HDF5 file, with 0, 1 and 2 loader workers, by
# paratrain (examples/transformer's transformer_ddp: data::Hdf5Dataset through
# data::Loader's worker threads) and by the PyTorch reference program (DataLoader(num_workers=
# ...) over an h5py Dataset read one sample per __getitem__). Prints, for each, the step time,
# the wait for data within it, that wait's share of the step, and what reading from the file
# adds to the step against memory; then the ratio of the two data waits, torch / paratrain.
# Builds nothing: cmake --build build --target transformer_ddp transformer_single.
#
# Usage: benchmarks/io_vs_torch.sh [steps in all, 8] [warm-up steps left out of the timing, 2] [rounds, 1]
# (at most 32 steps: one epoch of the reference's 2048 samples at 2 x 32 per step).
# Needs python3-torch, python3-h5py, jq and /usr/bin/time (PARATRAIN_WITH_PEER=1 scripts/deps.sh).
#
# Both sides: one intra-op thread per rank, rank r pinned to core r (its loader workers,
# threads or processes, inherit that core), and the same glibc allocator settings, set here
# for both: MALLOC_MMAP_THRESHOLD_=67108864 MALLOC_TRIM_THRESHOLD_=2147483647 (paratrain's
# defaults, Note [Allocator]). The file is written once by transformer_single --write-data
# (the reference's torch.rand data, datasets src [2048, 1, 512] and tgt [2048, 20, 512], float32,
# 84 MiB) and read by both sides; after the first run it is in the page cache, as a data
# set that fits in memory is after its first epoch: this measures the cost of the format
# and the loading path, not of the disk. Each figure is the slowest rank's mean over the
# timed steps; with several rounds the best step time of each configuration is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-8}
warmup=${2:-2}
rounds=${3:-1}
build=${PARATRAIN_BUILD_DIR:-build-bench}
python=/usr/bin/python3
. benchmarks/side_by_side.sh  # require_built, same_environment, run_clean, machine_line
require_built "$build" transformer_ddp transformer_single
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
same_environment "$0" "$steps" "$warmup" "$rounds"
"$build/examples/transformer_single" --write-data "$tmp/data.h5" >&2

export RUN_CLEAN_TRIES=3
for ((round = 1; round <= rounds; ++round)); do
  for workers in 0 1 2; do
    for data in memory hdf5; do
      echo "-- round $round of $rounds: $data, $workers worker(s)" >&2
      file=()
      [[ $data == hdf5 ]] && file=(--data "$tmp/data.h5")
      run_clean scripts/mpirun.sh 2 "$build/examples/transformer_ddp" --steps "$steps" --warmup "$warmup" \
        --workers "$workers" "${file[@]}"
      run_clean "$python" benchmarks/transformer_vs_torch.py --ranks 2 --steps "$steps" --warmup "$warmup" --bind \
        --workers "$workers" "${file[@]}"
    done
  done
done

jq -rs -L benchmarks 'include "table";
  def best(s; d; w): map(select(side == s and .data == d and .workers == w)) | min_by(.ms_per_step);
  . as $all
  | "| workers | data | paratrain ms/step | data wait ms/step | wait share | file adds | PyTorch ms/step | data wait ms/step | wait share | file adds | data wait torch/paratrain |",
    "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ([0, 1, 2][] as $w | ["memory", "hdf5"][] as $d
      | [["paratrain", "pytorch"][] as $s | ($all | best($s; $d; $w)) as $r | ($all | best($s; "memory"; $w)) as $m
          | [($r.ms_per_step | f(1)), ($r.data_ms_per_step | f(2)),
             (100 * $r.data_ms_per_step / $r.ms_per_step | f(2)) + "%",
             (if $d == "memory" then "—" else (100 * ($r.ms_per_step - $m.ms_per_step) / $m.ms_per_step | f(1)) + "%" end)]]
      | ($all | best("paratrain"; $d; $w)) as $ours | ($all | best("pytorch"; $d; $w)) as $torch
      | "| \($w) | \($d) | \(.[0] | join(" | ")) | \(.[1] | join(" | ")) | "
        + (if $ours.data_ms_per_step > 0 then ($torch.data_ms_per_step / $ours.data_ms_per_step | f(1)) + "×" else "—" end) + " |"),
    "",
    "ms/step and data wait: the slowest rank'"'"'s means over \($all[0].steps - $all[0].warmup) timed steps after \($all[0].warmup)"
    + " warm-up steps, 2 ranks, batch 32 per rank; best of \(length / 12) round(s). Wait share: data wait / step time."
    + " File adds: (step time from the file - from memory) / step time from memory, same side and workers (negative: noise)."
    + " Others'"'"' CPU during each run: \(map(.others_cpu) | max) of a core at most."
' "$tmp/results"
echo
echo "Command: $command"
machine_line

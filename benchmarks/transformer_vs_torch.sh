#!/usr/bin/env bash
# examples/transformer's DDP build beside the PyTorch reference program (transformer_vs_torch.py), PyTorch's own DDP (gloo),
# same model (torch.nn.Transformer(), 44.1M parameters), data, batch (32 per rank), Adam
# and machine, 2 ranks each: prints both step times and the ratio torch / paratrain.
# Builds nothing: build transformer_ddp first (cmake --build build --target transformer_ddp).
#
# Usage: benchmarks/transformer_vs_torch.sh [steps in all, 8] [warm-up steps left out of the timing, 2] [rounds, 1]
# (at most 32 steps: one epoch of the reference's 2048 samples at 2 x 32 per step).
# Needs python3-torch, jq and /usr/bin/time (PARATRAIN_WITH_PEER=1 scripts/deps.sh).
#
# Both sides run with one intra-op thread per rank, rank r pinned to core r, and the same
# glibc allocator settings, set here for both:
#   MALLOC_MMAP_THRESHOLD_=67108864 MALLOC_TRIM_THRESHOLD_=2147483647
# (paratrain's own defaults, Note [Allocator]; stated for PyTorch too, so both are equal).
# GLIBC_TUNABLES and OMPI_MCA_* in the environment reach both runs and are printed with
# the command. Each side's time is the slowest rank's mean step time over the timed steps;
# with several rounds (the two sides in turn) the best is kept. Timings are only as good as
# the machine is idle: before each run the script waits for the CPUs to go quiet, and a run
# during which other processes took more than 10% of a core is repeated (up to 3 times;
# the last one is kept with a warning). The table gives that share for the runs kept.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-8}
warmup=${2:-2}
rounds=${3:-1}
build=${PARATRAIN_BUILD_DIR:-build-bench}
bench=$build/examples/transformer_ddp
python=/usr/bin/python3
. benchmarks/side_by_side.sh  # require_built, same_environment, run_clean, machine_line
require_built "$build" transformer_ddp
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
same_environment "$0" "$steps" "$warmup" "$rounds"  # sets $command
export RUN_CLEAN_TRIES=3
for ((round = 1; round <= rounds; ++round)); do
  echo "-- round $round of $rounds" >&2
  run_clean scripts/mpirun.sh 2 "$bench" --steps "$steps" --warmup "$warmup"
  run_clean "$python" benchmarks/transformer_vs_torch.py --ranks 2 --steps "$steps" --warmup "$warmup" --bind
done

jq -rs -L benchmarks 'include "table";
  (map(select(.implementation == "pytorch")) | min_by(.ms_per_step)) as $torch
  | (map(select(.example == "transformer")) | min_by(.ms_per_step)) as $ours
  | "| implementation | ranks | batch/rank | parameters | timed steps | ms/step | others'"'"' CPU | ratio torch/paratrain |",
    "|---|---:|---:|---:|---:|---:|---:|---:|",
    "| PyTorch DDP (gloo), the reference program | \($torch.world_size) | \($torch.batch_per_replica) | \($torch.parameters)"
    + " | \($torch.steps - $torch.warmup) | \($torch.ms_per_step | f(1)) | \($torch.others_cpu) | — |",
    "| paratrain DataParallel (comm::Mpi), transformer_ddp | \($ours.world_size) | \($ours.batch_per_replica)"
    + " | \($ours.parameters) | \($ours.steps - $ours.warmup) | \($ours.ms_per_step | f(1)) | \($ours.others_cpu)"
    + " | \($torch.ms_per_step / $ours.ms_per_step | f(2))× |",
    "",
    "ms/step: the slowest rank'"'"'s mean over the timed steps, after \($ours.warmup) warm-up steps; best of \(length / 2)"
    + " round(s) per side. Every round: \(map("\(if .implementation == "pytorch" then "PyTorch" else "paratrain" end)"
    + " \(.ms_per_step | f(1))") | join(", ")). Others'"'"' CPU: the share of a core other processes took during the run."
' "$tmp/results"
echo
echo "Command: $command"
machine_line

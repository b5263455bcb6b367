#!/usr/bin/env bash
# paratrain's DataParallel against PyTorch's own DDP (gloo), same model, data and machine:
# runs benchmarks/ddp_vs_torch.py and bench_ddp_vs_torch at 1 and 2 ranks and prints a
# markdown table with the ratios. Builds nothing: build bench_ddp_vs_torch first.
#
# Usage: benchmarks/ddp_vs_torch.sh [timed steps per run, 200] [rounds, 3]
# Needs python3-torch, jq and /usr/bin/time (PARATRAIN_WITH_PEER=1 scripts/deps.sh).
# GLIBC_TUNABLES and OMPI_MCA_* in the environment reach every run and are printed with
# the command (docs/benchmarks.md uses both).
#
# Each run is repeated `rounds` times (the four runs in turn) and the median is kept.
# Timings are only as good as the machine is idle: before each run the script waits
# for the CPUs to go quiet, and a run during which other processes took more than 10%
# of a core is repeated (up to 5 times; the last one is kept with a warning).
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-200}
rounds=${2:-3}
build=${PARATRAIN_BUILD_DIR:-build-bench}
bench=$build/benchmarks/bench_ddp_vs_torch
python=/usr/bin/python3
if [[ ! -x $bench ]]; then
  echo "$bench is missing; build it: cmake --build $build --target bench_ddp_vs_torch" >&2
  exit 1
fi
# One intra-op thread per rank, whichever threading layer the BLAS uses.
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

. benchmarks/side_by_side.sh  # busy_ticks, wait_quiet, run_clean, machine_line

# The exact command, with the environment that changes the numbers (allocator, MPI tuning).
command="$({ env | grep -E '^(GLIBC_TUNABLES|OMPI_MCA_[A-Za-z0-9_]+)=' || true; } | sort | tr '\n' ' ')$0 $steps $rounds"
echo "Command: $command" >&2
for ((round = 1; round <= rounds; ++round)); do
  echo "-- round $round of $rounds" >&2
  run_clean "$python" benchmarks/ddp_vs_torch.py --ranks 1 --steps "$steps" --bind
  run_clean scripts/mpirun.sh 1 "$bench" --steps "$steps"
  run_clean "$python" benchmarks/ddp_vs_torch.py --ranks 2 --steps "$steps" --bind
  run_clean scripts/mpirun.sh 2 "$bench" --steps "$steps"
done

# The table: medians over rounds; efficiency = steps/s at 2 ranks / steps/s at 1 rank
# (the batch per rank is fixed, so 2 ranks take twice the samples per step).
jq -rs -L benchmarks 'include "table";
  def median: sort | .[length / 2 | floor];
  group_by([.implementation, .ranks]) | map({
    implementation: .[0].implementation, ranks: .[0].ranks, runs: length,
    sps: (map(.steps_per_s) | median), no_comm: (map(.no_comm_steps_per_s) | median),
    exposed: (map(.exposed_comm_share // null) | if .[0] == null then null else median end)}) as $rows
  | def at(i; r): $rows | map(select(.implementation == i and .ranks == r)) | .[0];
  "| implementation | ranks | steps/s | scaling efficiency | exposed comm share | ratio paratrain/PyTorch at same ranks | no-comm steps/s |",
  "|---|---:|---:|---:|---:|---:|---:|",
  ($rows | sort_by(.implementation != "pytorch", .ranks)[] as $r
   | at($r.implementation; 1) as $one
   | at("pytorch"; $r.ranks) as $torch
   | "| \(if $r.implementation == "pytorch" then "PyTorch DDP (gloo)" else "paratrain DataParallel (comm::Mpi)" end)"
     + " | \($r.ranks) | \($r.sps | f(1)) | \(if $r.ranks == 1 then "—" else ($r.sps / $one.sps * 100 | f(0)) + "%" end)"
     + " | \(if $r.exposed == null then "n/a" else ($r.exposed * 100 | f(1)) + "%" end)"
     + " | \(if $r.implementation == "pytorch" then "—" else ($r.sps / $torch.sps | f(2)) + "×" end)"
     + " | \($r.no_comm | f(1)) |"),
  "",
  "Efficiency against plain single-process training of the same step (no DDP wrapper, 1 rank): "
  + ([$rows[] | select(.ranks == 2)
       | "\(if .implementation == "pytorch" then "PyTorch" else "paratrain" end) \(.sps / at(.implementation; 1).no_comm * 100 | f(0))%"]
     | join(", ")) + ".",
  "Medians of \($rows[0].runs) runs. steps/s: optimizer steps per second; all ranks step together, each on its own"
  + " batch of 64, so 2 ranks take 128 samples per step."
' "$tmp/results"
echo
echo "Command: $command"
machine_line

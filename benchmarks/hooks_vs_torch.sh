#!/usr/bin/env bash
# Gradient compression, paratrain's hooks against PyTorch's comm hooks, side by side at 2
# ranks: the exact sum, fp16 (NarrowGradients / fp16_compress_hook), bf16 (paratrain only:
# 1.13's bf16_compress_hook needs NCCL) and PowerSGD (PowerSgd; paratrain only, below) at each
# rank given, on the model and data of benchmarks/ddp_vs_torch.sh (MLP 784-1024-1024-10,
# Adam, batch 64 per rank). Prints a markdown table: steps/s, each against the same side's
# exact sum and against PyTorch's same hook, and the gradient bytes a rank sends per step.
# Builds nothing: build bench_ddp_vs_torch first (scripts/bench.sh hooks builds it and runs this).
#
# Usage: benchmarks/hooks_vs_torch.sh [timed steps per run, 200] [rounds, 3] [PowerSGD ranks, "1 4"]
# Needs python3-torch and jq (PARATRAIN_WITH_PEER=1 scripts/deps.sh). Both sides run with the
# same allocator settings and one intra-op thread per rank (same_environment).
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-200}
rounds=${2:-3}
ranks_of_powersgd=${3:-"1 4"}
build=${PARATRAIN_BUILD_DIR:-build-bench}
python=/usr/bin/python3
. benchmarks/side_by_side.sh  # benchmark_setup, same_environment, run_clean, machine_line
benchmark_setup bench_ddp_vs_torch
same_environment "$0" "$steps" "$rounds" "\"$ranks_of_powersgd\""

for ((round = 1; round <= rounds; ++round)); do
  echo "-- round $round of $rounds" >&2
  for hook in none fp16 bf16 $(for r in $ranks_of_powersgd; do echo "powersgd:$r"; done); do
    name=${hook%%:*}
    rank=1
    [[ $hook == *:* ]] && rank=${hook#*:}
    # PyTorch 1.13's powerSGD_hook over Gloo did not finish here: both ranks asleep after
    # their first steps, for 10 minutes (ddp_vs_torch.py --hook powersgd; run it by hand
    # where a newer PyTorch is at hand). Its column stays empty.
    if [[ $name != bf16 && $name != powersgd ]]; then
      run_clean "$python" benchmarks/ddp_vs_torch.py --ranks 2 --steps "$steps" --bind --hook "$name" --powersgd-rank "$rank"
    fi
    run_clean scripts/mpirun.sh 2 "$bench" --steps "$steps" --hook "$name" --powersgd-rank "$rank"
  done
done

jq -rs -L benchmarks 'include "table";
  def hook_name: if .hook == "powersgd" then "PowerSGD rank \(.powersgd_rank)" elif .hook == "none" then "exact sum"
             else .hook end;
  group_by([side, .hook, .powersgd_rank]) | map({
    side: (.[0] | side), hook: .[0].hook, powersgd_rank: .[0].powersgd_rank, label: (.[0] | hook_name), runs: length,
    sps: (map(.steps_per_s) | median), bytes: (.[0].bytes_sent_per_step // null)}) as $rows
  | def at(s; h; r): $rows | map(select(.side == s and .hook == h and .powersgd_rank == r)) | .[0];
  "| hook | paratrain steps/s | × its exact sum | PyTorch steps/s | × its exact sum | paratrain / PyTorch | bytes sent per step per rank | × exact |",
  "|---|---:|---:|---:|---:|---:|---:|---:|",
  ($rows | map(select(.side == "paratrain")) | sort_by(.hook != "none", .hook, .powersgd_rank)[] as $r
   | at("paratrain"; "none"; 0) as $exact
   | at("pytorch"; $r.hook; $r.powersgd_rank) as $torch
   | at("pytorch"; "none"; 0) as $torch_exact
   | "| \($r.label) | \($r.sps | f(1)) | \($r.sps / $exact.sps | f(2)) | "
     + (if $torch == null then "— | — | —" else "\($torch.sps | f(1)) | \($torch.sps / $torch_exact.sps | f(2)) | \($r.sps / $torch.sps | f(2))" end)
     + " | \($r.bytes) | \($r.bytes / $exact.bytes | f(3)) |"),
  "",
  "Medians of \($rows[0].runs) runs at 2 ranks; steps/s: optimizer steps per second, each rank on its own batch of 64."
' "$tmp/results"
echo
echo "Command: $command"
machine_line

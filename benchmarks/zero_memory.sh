#!/usr/bin/env bash
# Peak memory per rank of paratrain's DDP and ZeRO stages 1-3 against paratrain::plan::peak:
# one process per rank and configuration (bench_zero, zero.hpp), its peak resident set
# (VmHWM) above the baseline it had before the model was built, beside the plan's figure
# for the same model, stage and world size (Note [Peak memory model]), and the peak of the
# construction alone (at stage 3 built sharded: Note [Sharded construction]). Prints a
# markdown table. Builds nothing: build bench_zero first (scripts/bench.sh zero_memory does both).
#
# Usage: benchmarks/zero_memory.sh [layers, "4 12 48"] [ranks, "2 4"] [timed steps, 3] [fp32 or bf16, fp32]
# bf16: forward under bf16 autocast (Precision::autocast), where ZeRO-3 gathers its units in
# bf16 from the second step on (Note [Gathers in the compute type]).
# Layers of Linear(2048, 2048): 4 are 16.8M parameters, 12 are 50.4M, 48 are 201M.
# Allocator: paratrain's defaults (Note [Allocator]), nothing in the environment.
set -euo pipefail
cd "$(dirname "$0")/.."
sizes=${1:-"4 12 48"}
worlds=${2:-"2 4"}
steps=${3:-3}
precision=${4:-fp32}
build=${PARATRAIN_BUILD_DIR:-build-bench}
python=/usr/bin/python3  # for machine_line
. benchmarks/side_by_side.sh  # benchmark_setup, machine_line
benchmark_setup bench_zero

for layers in $sizes; do
  for ranks in $worlds; do
    for strategy in ddp zero1 zero2 zero3; do
      flags=(--strategy "$strategy" --layers "$layers" --steps "$steps" --warmup 1)
      [[ $precision == bf16 ]] && flags+=(--bf16)
      echo "\$ scripts/mpirun.sh $ranks $bench ${flags[*]}" >&2
      scripts/mpirun.sh "$ranks" "$bench" "${flags[@]}" | tee -a "$tmp/results" >&2
    done
  done
done

jq -rs '
  def f(d): . * pow(10; d) | round / pow(10; d) | tostring;
  . as $rows
  | def ddp(r): $rows | map(select(.strategy == "ddp" and .layers == r.layers and .ranks == r.ranks)) | .[0];
  "| model | ranks | strategy | baseline MiB | peak − baseline MiB | plan::peak MiB | measured / plan | × DDP peak | construction − baseline MiB | steps/s | × DDP steps/s |",
  "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
  ($rows | sort_by(.layers, .ranks)[] as $r
   | "| \($r.parameters / 1e6 | f(1))M | \($r.ranks) | \($r.strategy) | \($r.baseline_mib | f(0))"
     + " | \($r.peak_above_baseline_mib | f(0)) | \($r.plan_peak_mib | f(0))"
     + " | \(($r.peak_above_baseline_mib / $r.plan_peak_mib) | f(2))"
     + " | \(($r.peak_above_baseline_mib / ddp($r).peak_above_baseline_mib) | f(2))"
     + " | \($r.construction_above_baseline_mib | f(0)) | \($r.steps_per_s | f(2))"
     + " | \(($r.steps_per_s / ddp($r).steps_per_s) | f(2)) |")
' "$tmp/results"
echo
echo "Command: $0 \"$sizes\" \"$worlds\" $steps $precision (one intra-op thread per rank)"
machine_line

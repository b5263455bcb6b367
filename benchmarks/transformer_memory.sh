#!/usr/bin/env bash
# The Transformer example's peak memory per rank under paratrain's DDP and ZeRO-3, fp32 and
# bf16 (--bf16: autocast, and at ZeRO-3 units gathered in bf16: Note [Gathers in the
# compute type]): each build's summary line gives the baseline (VmRSS before the model is
# built), the peak (VmHWM) above it and paratrain::plan::peak for the strategy, the largest
# over the ranks. plan::peak has no activation estimate here, so `measured − plan` is the
# activations plus what the plan never counts (Note [Peak memory model]). Prints a markdown
# table. Builds nothing: build transformer_ddp and transformer_zero3 first
# (scripts/bench.sh transformer_memory does both).
#
# Usage: benchmarks/transformer_memory.sh [ranks, 2] [steps, 6] [target length, 20]
# Allocator: paratrain's defaults (Note [Allocator]), nothing in the environment.
set -euo pipefail
cd "$(dirname "$0")/.."
ranks=${1:-2}
steps=${2:-6}
tgt_len=${3:-20}
build=${PARATRAIN_BUILD_DIR:-build-bench}
python=/usr/bin/python3  # for machine_line
. benchmarks/side_by_side.sh  # require_built, machine_line
require_built "$build" transformer_ddp transformer_zero3
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

for precision in fp32 bf16; do
  flags=()
  [[ $precision == bf16 ]] && flags=(--bf16)
  for b in ddp zero3; do
    cmd=(scripts/mpirun.sh "$ranks" "$build/examples/transformer_$b" --steps "$steps" --tgt-len "$tgt_len"
         --samples $((steps * 32 * ranks)) --workers 0 "${flags[@]}")
    echo "\$ ${cmd[*]}" >&2
    "${cmd[@]}" | grep '^{"example"' | tee -a "$tmp/results" >&2
  done
done

jq -rs '
  def f(d): . * pow(10; d) | round / pow(10; d) | tostring;
  def prec: if .bf16 then "bf16" else "fp32" end;
  . as $rows
  | def ddp(r): $rows | map(select(.strategy == "ddp" and .bf16 == r.bf16)) | .[0];
  "| strategy | precision | baseline MiB | peak − baseline MiB | plan::peak MiB | measured − plan MiB | × DDP peak | ms/step |",
  "|---|---|---:|---:|---:|---:|---:|---:|",
  ($rows[] as $r
   | "| \($r.strategy) | \($r | prec) | \($r.baseline_mib | f(0)) | \($r.peak_above_baseline_mib | f(0))"
     + " | \($r.plan_peak_mib | f(0)) | \(($r.peak_above_baseline_mib - $r.plan_peak_mib) | f(0))"
     + " | \(($r.peak_above_baseline_mib / ddp($r).peak_above_baseline_mib) | f(2)) | \($r.ms_per_step | f(0)) |")
' "$tmp/results"
echo
echo "Command: $0 $ranks $steps $tgt_len (the example's defaults otherwise: d_model 512, 6+6 layers, batch 32 per rank; one intra-op thread per rank)"
machine_line

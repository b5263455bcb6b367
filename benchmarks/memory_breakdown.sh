#!/usr/bin/env bash
# Where a rank's peak memory goes, beside paratrain::plan::peak: bench_zero (zero.hpp) with
# --breakdown, once per strategy, model and allocator. Rank 0 reports, all above its
# baseline (the process before the model): its peak resident set (VmHWM), its tensors'
# peak counted at LibTorch's CPU allocator (memory::CountingCpuAllocator), and after the
# last step its resident set by kind (memory::usage: glibc's heap, other anonymous memory,
# shared memory, mapped files) and glibc's own account of its heap (bytes in use, bytes
# free but kept, blocks mapped on their own). Prints a markdown table.
# Builds nothing: build bench_zero first (scripts/bench.sh memory_breakdown builds it).
#
# Usage: benchmarks/memory_breakdown.sh [layers, "4 12"] [ranks, 2] [timed steps, 6] [allocators, "paratrain jemalloc"]
# Allocators: paratrain: glibc with paratrain's settings (Note [Allocator]; memory::install);
# glibc: PARATRAIN_MALLOC=default (glibc's own thresholds); jemalloc: Debian's libjemalloc2
# preloaded (memory::install then reaches nothing; glibc's heap columns stay empty).
set -euo pipefail
cd "$(dirname "$0")/.."
sizes=${1:-"4 12"}
ranks=${2:-2}
steps=${3:-6}
allocators=${4:-"paratrain jemalloc"}
build=${PARATRAIN_BUILD_DIR:-build-bench}
python=/usr/bin/python3  # for machine_line
. benchmarks/side_by_side.sh  # benchmark_setup, machine_line
benchmark_setup bench_zero
jemalloc=$(ls /usr/lib/*/libjemalloc.so.2 2>/dev/null | head -1 || true)

for allocator in $allocators; do
  env=()
  case $allocator in
    paratrain) ;;
    glibc) env=(PARATRAIN_MALLOC=default) ;;
    jemalloc)
      [[ -n $jemalloc ]] || { echo "libjemalloc2 is not installed (PARATRAIN_WITH_PEER=1 scripts/deps.sh installs it)" >&2; exit 1; }
      env=(LD_PRELOAD="$jemalloc") ;;
    *) echo "unknown allocator $allocator (paratrain, glibc, jemalloc)" >&2; exit 2 ;;
  esac
  for layers in $sizes; do
    for strategy in ddp zero1 zero2 zero3; do
      flags=(--strategy "$strategy" --layers "$layers" --steps "$steps" --warmup 1 --breakdown)
      echo "\$ ${env[*]} scripts/mpirun.sh $ranks $bench ${flags[*]}" >&2
      env "${env[@]}" scripts/mpirun.sh "$ranks" "$bench" "${flags[@]}" |
        jq -c --arg a "$allocator" '. + {allocator: $a}' | tee -a "$tmp/results" >&2
    done
  done
done

jq -rs '
  def f(d): . * pow(10; d) | round / pow(10; d) | tostring;
  "| allocator | model | strategy | peak − baseline | tensors peak | plan::peak | peak / tensors | heap in use | heap free, kept | heap mapped | other anonymous | shared | files | steps/s |",
  "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
  (.[] | "| \(.allocator) | \(.parameters / 1e6 | f(1))M | \(.strategy) | \(.r0_peak_above_baseline_mib | f(0))"
     + " | \(.r0_tensors_peak_mib | f(0)) | \(.plan_peak_mib | f(0))"
     + " | \((.r0_peak_above_baseline_mib / .r0_tensors_peak_mib) | f(2))"
     + " | \(.r0_heap_in_use_mib | f(0)) | \(.r0_heap_free_mib | f(0)) | \(.r0_heap_mapped_mib | f(0))"
     + " | \((.r0_anonymous_resident_mib - .r0_heap_mapped_mib) | f(0)) | \(.r0_shared_resident_mib | f(0))"
     + " | \(.r0_file_resident_mib | f(0)) | \(.steps_per_s | f(2)) |")
' "$tmp/results"
echo
echo "MiB, rank 0, above its baseline; the heap and kind columns after the last step. Ranks: $ranks."
echo "Command: $0 \"$sizes\" $ranks $steps \"$allocators\" (one intra-op thread per rank)"
machine_line

#!/usr/bin/env bash
# Regenerates the docs' pictures (docs/pictures/*.png) from the data in docs/pictures/data:
# builds pipeline_tables (torch-free, seconds) with cmake --build, records the schedules'
# simulated timelines with it (pipeline_tables --json), checks docs/pipeline.md's generated
# section, then draws every picture with scripts/pictures.py (Debian's /usr/bin/python3
# and python3-matplotlib: PARATRAIN_WITH_DOCS=1 scripts/deps.sh installs it).
#
# With --record it also re-records the measured data first, from programs already built
# (it names the build command of a missing one; building them is minutes of LibTorch):
#   ddp_trace.json   fit's trace of 4 steps of transformer_ddp on 2 ranks (build/examples)
#   memory.json      bench_zero --breakdown per ZeRO stage, 2 ranks (build-bench/benchmarks)
# scaling.json is transcribed from docs/benchmarks.md ("DDP vs PyTorch DDP"), never measured
# here: edit it when that table changes.
#
# Usage: scripts/pictures.sh [--record]
set -euo pipefail
cd "$(dirname "$0")/.."
record=0
case "${1:-}" in
  "") ;;
  --record) record=1 ;;
  *) echo "usage: scripts/pictures.sh [--record]" >&2; exit 2 ;;
esac
PARATRAIN_WITH_DOCS=1 scripts/deps.sh  # python3-matplotlib, as the other docs scripts
build=${PARATRAIN_BUILD_DIR:-build}
bench_build=${PARATRAIN_BENCH_BUILD_DIR:-build-bench}
data=docs/pictures/data
python=/usr/bin/python3
mkdir -p "$data"

[[ -f $build/CMakeCache.txt ]] || scripts/build.sh --configure-only
cmake --build "$build" --target pipeline_tables
"$build/tests/pipeline_tables" --json >"$data/pipeline_schedules.json.tmp"
mv "$data/pipeline_schedules.json.tmp" "$data/pipeline_schedules.json"
"$build/tests/pipeline_tables" --check docs/pipeline.md

if ((record)); then
  need() {
    [[ -x $1 ]] || { echo "$1 is missing; build it: cmake --build $2 --target $(basename "$1")" >&2; exit 1; }
  }
  need "$build/examples/transformer_ddp" "$build"
  need "$bench_build/benchmarks/bench_zero" "$bench_build"
  export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT

  # One DDP step's phases and bucket all-reduces: the default Transformer (44 M parameters,
  # 8 buckets), 4 steps of 32 samples per rank.
  scripts/mpirun.sh 2 "$build/examples/transformer_ddp" --samples 256 --max-steps 4 --warmup 1 \
    --trace "$tmp/trace.json" >&2
  mv "$tmp/trace.json" "$data/ddp_trace.json"

  # Rank 0's memory per stage beside plan::peak (the columns of benchmarks/memory_breakdown.sh).
  for stage in ddp zero1 zero2 zero3; do
    scripts/mpirun.sh 2 "$bench_build/benchmarks/bench_zero" --strategy "$stage" --layers 4 --steps 6 --warmup 1 \
      --breakdown | tail -1 >>"$tmp/memory.jsonl"
  done
  libtorch=$(dpkg-query -W -f '${Version}' libtorch-dev 2>/dev/null || echo '?')
  machine="$(env -u OMP_NUM_THREADS nproc) cores ($(lscpu | sed -n 's/^Model name: *//p')), \
$(. /etc/os-release && echo "$PRETTY_NAME"), LibTorch $libtorch, $(mpirun --version | head -1); \
paratrain's allocator defaults (Note [Allocator]); one intra-op thread per rank"
  commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  "$python" - "$tmp/memory.jsonl" "$data/memory.json" "$machine" "$commit" <<'EOF'
import json, sys
lines, out, machine, commit = sys.argv[1:]
doc = {
    "what": "rank 0's memory per ZeRO stage against paratrain::plan::peak: bench_zero --breakdown "
            "(benchmarks/zero.hpp), the columns of benchmarks/memory_breakdown.sh; MiB above the process's "
            "baseline (LibTorch started, before the model)",
    "command": "for s in ddp zero1 zero2 zero3; do OMP_NUM_THREADS=1 scripts/mpirun.sh 2 "
               "build-bench/benchmarks/bench_zero --strategy $s --layers 4 --steps 6 --warmup 1 --breakdown "
               "| tail -1; done",
    "recorded_by": "scripts/pictures.sh --record; each run's JSON line as bench_zero printed it",
    "machine": machine,
    "commit": commit,
    "runs": [json.loads(line) for line in open(lines)],
}
with open(out, "w") as f:
    json.dump(doc, f, indent=1)
    f.write("\n")
EOF
fi

"$python" scripts/pictures.py --data "$data" --out docs/pictures

#!/usr/bin/env bash
# Installs what is missing, configures and builds paratrain's tests and examples (the
# benchmarks: scripts/bench.sh builds the ones it runs).
# Usage: scripts/build.sh [--configure-only | cmake --build arguments, e.g. --target paratrain_tests]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
build=${PARATRAIN_BUILD_DIR:-build}
# The tests' and examples' build is not optimised (-O0): what those programs spend their
# time in is LibTorch and MPI, compiled already (the demo's DDP run: 9,000-10,500 samples/s
# at -O0 and at -O1 alike), and they compile in much less time (tests/unit/sharded_test.cpp:
# 57 s at -O3, 33 s at -O1; an example 18% less at -O0 than at -O1). The benchmarks are built
# at -O3, in a folder of their own (scripts/bench.sh). One level per folder: a precompiled
# header is reused only at the level it was made with (g++ 12 crashed on one made at -O1 and
# used at -O3).
opt=${PARATRAIN_OPT:--O0}
if ! grep -qxF "CMAKE_CXX_FLAGS_RELEASE:STRING=$opt -DNDEBUG" "$build/CMakeCache.txt" 2>/dev/null ||
   [[ ! -f "$build/build.ninja" ]]; then
  [[ -f "$build/build.ninja" ]] &&
    echo "paratrain: $build was configured at another optimisation level; configuring it at $opt (all of it recompiles)" >&2
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE="$opt -DNDEBUG" >/dev/null
fi
[[ ${1:-} == --configure-only ]] && exit 0
# Each LibTorch translation unit takes ~1.3 GB to compile: one job per core at most.
cmake --build "$build" -j "$(nproc)" "$@"

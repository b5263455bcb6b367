#!/usr/bin/env bash
# Installs what is missing, configures and builds paratrain's tests and examples (the
# benchmarks: scripts/bench.sh builds the ones it runs).
# Usage: scripts/build.sh [--configure-only | cmake --build arguments, e.g. --target paratrain_tests]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
build=${PARATRAIN_BUILD_DIR:-build}
if [[ ! -f "$build/build.ninja" ]]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
fi
[[ ${1:-} == --configure-only ]] && exit 0
# Each LibTorch translation unit takes ~1.3 GB to compile: one job per core at most.
cmake --build "$build" -j "$(nproc)" "$@"

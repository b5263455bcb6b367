#!/usr/bin/env bash
# The whole test suite: installs what is missing, builds, and runs ctest (the MPI tests
# under mpirun with 1 to 4 ranks, the compile-fail tests, the consumer builds), then the
# sanitizer run (scripts/sanitize.sh; PARATRAIN_SANITIZE_STAGE=0 leaves it out), then the
# suite against LibTorch 2.6 in a Debian 13 root (scripts/compat.sh;
# PARATRAIN_COMPAT_STAGE=0 leaves it out). Ends with each phase's wall time and the
# slowest build targets and tests. Arguments go to the main ctest run.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${PARATRAIN_BUILD_DIR:-build}
source scripts/phases.sh
trap 'phases_report "$build"' EXIT

phase deps scripts/deps.sh
phase configure scripts/build.sh --configure-only
phase build scripts/build.sh
# Two at a time: a test of N processes (PROCESSORS N) runs alone on 2 cores, and
# the timing-sensitive ones say so (tests/CMakeLists.txt).
phase ctest bash -c 'cd "$1" && shift && ctest --output-on-failure -j "$(nproc)" "$@"' ctest "$build" "$@"
if [[ ${PARATRAIN_SANITIZE_STAGE:-1} != 0 ]]; then
  phase sanitizer scripts/sanitize.sh
fi
if [[ ${PARATRAIN_COMPAT_STAGE:-1} != 0 ]]; then
  phase "libtorch 2.6" scripts/compat.sh
fi

#!/usr/bin/env bash
# The whole test suite: installs what is missing, builds, and runs ctest (the MPI tests
# under mpirun with 1, 2 and 4 ranks, the compile-fail tests, the consumer builds).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
cd "${PARATRAIN_BUILD_DIR:-build}"
ctest --output-on-failure "$@"

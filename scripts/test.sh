#!/usr/bin/env bash
# The whole test suite: installs what is missing, builds, and runs ctest (the MPI tests
# under mpirun with 1, 2 and 4 ranks, the compile-fail tests, the consumer builds), then the
# sanitizer run (scripts/sanitize.sh; PARATRAIN_SANITIZE_STAGE=0 leaves it out).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
(cd "${PARATRAIN_BUILD_DIR:-build}" && ctest --output-on-failure "$@")
if [[ ${PARATRAIN_SANITIZE_STAGE:-1} != 0 ]]; then
  scripts/sanitize.sh
fi

#!/usr/bin/env bash
# The main job: installs what is missing, builds, and trains a CNN on Fashion-MNIST
# with DDP on 2 processes (paratrain::DataParallel over comm::Mpi).
# Usage: scripts/demo.sh [--epochs N] [--batch B] [--lr LR]
# PARATRAIN_RANKS=4 changes the number of processes; PARATRAIN_STRATEGY=single|dp|ddp the build.
set -euo pipefail
cd "$(dirname "$0")/.."
strategy=${PARATRAIN_STRATEGY:-ddp}
ranks=${PARATRAIN_RANKS:-2}
scripts/build.sh --target "fashion_mnist_${strategy}"
program="${PARATRAIN_BUILD_DIR:-build}/examples/fashion_mnist_${strategy}"
if [[ "$strategy" == ddp ]]; then
  exec scripts/mpirun.sh "$ranks" "$program" "$@"
fi
exec "$program" "$@"

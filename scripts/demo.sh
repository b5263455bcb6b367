#!/usr/bin/env bash
# The main job: installs what is missing, builds, and trains a CNN on Fashion-MNIST
# with DDP on 2 processes (paratrain::DataParallel over comm::Mpi).
# Usage: scripts/demo.sh [--epochs N] [--batch B] [--lr LR]
# PARATRAIN_RANKS=4 changes the number of processes; PARATRAIN_STRATEGY the build: ddp (the
# default) or zero3 under mpirun, ddp_gloo under a torchrun-style launch, single as one process
# (the other aliases: examples/quickstart, `ctest -L quickstart`).
set -euo pipefail
cd "$(dirname "$0")/.."
strategy=${PARATRAIN_STRATEGY:-ddp}
ranks=${PARATRAIN_RANKS:-2}
case "$strategy" in
  single | ddp | ddp_gloo | zero3) ;;
  *) echo "paratrain: PARATRAIN_STRATEGY=$strategy: the demo's builds are single, ddp, ddp_gloo and zero3" \
          "(every strategy alias: examples/quickstart)" >&2
     exit 2 ;;
esac
scripts/build.sh --target "fashion_mnist_${strategy}"
program="${PARATRAIN_BUILD_DIR:-build}/examples/fashion_mnist_${strategy}"
case "$strategy" in
  ddp | zero3) exec scripts/mpirun.sh "$ranks" "$program" "$@" ;;
  ddp_gloo) exec tests/launch/torchrun_style.sh --timeout 86400 "$ranks" "$program" "$@" ;;
  *) exec "$program" "$@" ;;
esac

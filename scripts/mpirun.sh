#!/usr/bin/env bash
# mpirun with what Open MPI needs on a small machine: permission to run as root in
# containers, and more ranks than cores when asked for. One intra-op thread per rank.
# Usage: scripts/mpirun.sh <ranks> <program> [arguments...]
set -euo pipefail
ranks=$1
shift
# Count the cores first: nproc honours OMP_NUM_THREADS, so with it set to 1 it says 1.
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
bind=(--bind-to core)
if ((ranks > cores)); then bind=(--oversubscribe --bind-to none); fi
exec mpirun -n "$ranks" "${bind[@]}" "$@"

#!/usr/bin/env bash
# A program under plain mpirun: on this machine, or on the hosts of a hostfile. Without a
# program it runs the demo, fashion_mnist_ddp (DataParallel over comm::Mpi).
#
#   examples/launch/mpirun.sh [NP] [PROGRAM] [ARGS...]
#   examples/launch/mpirun.sh 2 build/train --epochs 2     your program
#   examples/launch/mpirun.sh 4 --epochs 2                 the demo (build/examples/fashion_mnist_ddp)
#   HOSTFILE=hosts PPN=8 examples/launch/mpirun.sh 16 ./train
#
# NP defaults to the number of cores here. PROGRAM is the first argument after NP that does
# not start with "-"; arguments starting with "-" right after NP go to the demo. A hostfile
# has lines like "node0 slots=8"; the program and the data must be at the same path on
# every host.
#
# What Open MPI needs, and why:
# - As root (containers), Open MPI refuses to start unless OMPI_ALLOW_RUN_AS_ROOT=1 and
#   OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 are set; this script sets them only when run as root.
# - More ranks than cores needs --oversubscribe, and then --bind-to none: bound ranks would
#   pile onto the same cores. With enough cores, --bind-to core keeps each rank on its own.
# - Each rank is one process per core: OMP_NUM_THREADS=1 (passed with -x) keeps LibTorch's
#   intra-op threads from fighting over the cores (paratrain::main sets one thread too).
# - MPICH and Intel MPI spell it `mpiexec -n NP -ppn PPN -genv OMP_NUM_THREADS 1`.
# - A comm::Gloo program can run under mpirun too (detect_placement() reads Open MPI's
#   OMPI_COMM_WORLD_* variables): add -x MASTER_ADDR=<first host> -x MASTER_PORT=29500.
set -euo pipefail

build=${BUILD_DIR:-build}
np=$(nproc)
if (($# > 0)) && [[ $1 =~ ^[1-9][0-9]*$ ]]; then
  np=$1
  shift
fi
program=$build/examples/fashion_mnist_ddp
if (($# > 0)) && [[ $1 != -* ]]; then
  program=$1
  shift
fi

args=(-n "$np" -x "OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}")
if ((EUID == 0)); then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
if [[ -n ${HOSTFILE:-} ]]; then
  args+=(--hostfile "$HOSTFILE" --map-by "ppr:${PPN:-1}:node" --bind-to core)
elif ((np > $(nproc))); then
  args+=(--oversubscribe --bind-to none)
else
  args+=(--bind-to core)
fi

exec mpirun "${args[@]}" "$program" "$@"

#!/bin/bash
# A program under PBS Pro with HPE Cray PALS (ALCF Polaris-style nodes: 4 GPUs and 32 cores
# each): 2 nodes, one rank per GPU. Without a program it runs the demo, fashion_mnist_ddp_nccl
# (DataParallel over comm::Nccl) for 5 epochs.
#
#   qsub examples/launch/pbs_pals.sh                         the demo (add -A <project> -q <queue>
#                                                            as your site requires)
#   qsub -v PROGRAM=$PWD/build/train examples/launch/pbs_pals.sh      your program
#   examples/launch/pbs_pals.sh build/train --epochs 5       your program with arguments, from
#                                                            inside a job (qsub -I)
#
# PALS's mpiexec starts the ranks; paratrain::detect_placement() reads PALS_RANKID,
# PALS_LOCAL_RANKID/PALS_LOCAL_SIZE and PMI_SIZE.
#
#PBS -N fashion-mnist-ddp
#PBS -l select=2:ncpus=32:ngpus=4
#PBS -l place=scatter
#PBS -l walltime=00:30:00
#PBS -j oe
set -euo pipefail

cd "${PBS_O_WORKDIR:-.}"
build=${BUILD_DIR:-build}

nodes=$(sort -u "${PBS_NODEFILE:?run this through qsub: PBS_NODEFILE is not set}" | wc -l)
ranks_per_node=4  # one per GPU
depth=8           # cores per rank: 32 cores / 4 ranks
ranks=$((nodes * ranks_per_node))

# --ppn places ranks_per_node ranks on each node; --depth reserves depth cores for each rank,
# and --cpu-bind depth binds each rank to its own block of them (the training thread, the
# loader's workers and the communicator's threads run on that rank's cores and no other's).
# --cpu-bind core would bind each rank to a single core instead. OMP_NUM_THREADS=1: one
# intra-op thread per rank, as paratrain::main sets by default (RuntimeOptions::threads); a
# program that wants more asks for them there.
#
# GPU choice: comm::Nccl takes the rank's index on its node modulo the node's visible GPUs,
# so local rank r takes GPU r without a wrapper. Sites that ship an affinity wrapper setting
# CUDA_VISIBLE_DEVICES from PMI_LOCAL_RANK (Polaris: set_affinity_gpu_polaris.sh) can put it
# before the program; each rank then sees one GPU, which the same rule picks, and the model
# goes there (--device cuda: paratrain::local_device). NCCL's ranks meet at MASTER_ADDR:
# MASTER_PORT (comm::Rendezvous). For the demo, BINARY=fashion_mnist_ddp trains on the CPU
# over comm::Mpi.
if (($# > 0)); then
  program=("$@")
elif [[ -n ${PROGRAM:-} ]]; then
  program=("$PROGRAM")
else
  binary=${BINARY:-fashion_mnist_ddp_nccl}
  program=("$build/examples/$binary" --epochs 5)
  [[ $binary == *nccl* ]] && program+=(--device cuda)
fi
command -v "${program[0]}" >/dev/null || {
  echo "$0: ${program[0]} is not an executable (the demo's NCCL build needs CUDA and NCCL when" \
       "configuring; BINARY=fashion_mnist_ddp trains on the CPU over MPI)" >&2
  exit 1
}
MASTER_ADDR=$(head -n 1 "$PBS_NODEFILE")
export MASTER_ADDR
MASTER_PORT=$((20000 + $(echo "${PBS_JOBID:-0}" | tr -cd 0-9 | tail -c 4 | sed 's/^0*//;s/^$/0/') % 20000))
export MASTER_PORT
mpiexec -n "$ranks" --ppn "$ranks_per_node" --depth "$depth" --cpu-bind depth \
  --env OMP_NUM_THREADS=1 --env MASTER_ADDR="$MASTER_ADDR" --env MASTER_PORT="$MASTER_PORT" \
  "${program[@]}"

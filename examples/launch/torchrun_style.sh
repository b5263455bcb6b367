#!/usr/bin/env bash
# Starts the ranks of a paratrain::comm::Gloo program on this node the way torchrun does:
# for a machine without MPI (a laptop, a container, a cloud VM), or several nodes by hand.
#
#   examples/launch/torchrun_style.sh NPROC_PER_NODE PROGRAM [ARGS...]
#
# One node (MASTER_ADDR defaults to 127.0.0.1, MASTER_PORT to torchrun's 29500):
#   examples/launch/torchrun_style.sh 4 build/tests/paratrain_gloo_tests
# Two nodes: run it on each, with node 0's address, a port open between the nodes, and the
# node's own NODE_RANK:
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 MASTER_PORT=29500 examples/launch/torchrun_style.sh 4 ./train
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 MASTER_PORT=29500 examples/launch/torchrun_style.sh 4 ./train
#
# Each process gets the variables torchrun exports, which paratrain::detect_placement() reads
# and a default-constructed comm::Gloo joins with (rank 0 listens on MASTER_PORT, the others
# connect to it): RANK = NODE_RANK * NPROC_PER_NODE + LOCAL_RANK, WORLD_SIZE = NNODES *
# NPROC_PER_NODE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (= NODE_RANK), MASTER_ADDR,
# MASTER_PORT. As torchrun does, OMP_NUM_THREADS defaults to 1 when there are several ranks.
#
# If a rank fails, the others on this node are stopped and the script exits with the failed
# rank's status. Ranks on other nodes notice within comm::Gloo::Options::timeout.
# Needs bash 4.3 or later (for `wait -n`).
set -euo pipefail

if (($# < 2)) || ! [[ $1 =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: [NNODES=n NODE_RANK=i MASTER_ADDR=host MASTER_PORT=port] $0 NPROC_PER_NODE PROGRAM [ARGS...]" >&2
  exit 2
fi
per_node=$1
shift
nnodes=${NNODES:-1}
node_rank=${NODE_RANK:-0}
if ((node_rank < 0 || node_rank >= nnodes)); then
  echo "$0: NODE_RANK=$node_rank is not in 0..$((nnodes - 1)) (NNODES=$nnodes)" >&2
  exit 2
fi

export MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
export MASTER_PORT=${MASTER_PORT:-29500}
export WORLD_SIZE=$((nnodes * per_node))
export LOCAL_WORLD_SIZE=$per_node
export GROUP_RANK=$node_rank
if ((per_node > 1)); then export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}; fi

pids=()
stop() {
  local pid
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
}
trap stop EXIT
trap 'exit 130' INT TERM

for ((local_rank = 0; local_rank < per_node; local_rank++)); do
  RANK=$((node_rank * per_node + local_rank)) LOCAL_RANK=$local_rank "$@" &
  pids+=($!)
done

# The first rank to fail ends the run; the EXIT trap stops the others.
for ((n = 0; n < per_node; n++)); do
  status=0
  wait -n || status=$?
  if ((status != 0)); then
    echo "$0: a rank exited with status $status; stopping the others on this node" >&2
    exit "$status"
  fi
done
pids=()  # all exited: nothing for the EXIT trap to stop

#!/usr/bin/env bash
# each_rank.sh <program> <args>: one rank of an mpirun job started by inject.sh, with its
# stdout and stderr in a file of its own, $PARATRAIN_RANK_LOGS/rank.<r>, which inject.sh
# reads after the job. Open MPI 5's prterun splices the output of ranks that write at the
# same moment, --tag-output or not (CI saw rank 1's one-line message cut in two around rank
# 0's, under rank 0's tag), so a check of what a rank said reads that rank's own file.
set -u
rank=${OMPI_COMM_WORLD_RANK:-${PMIX_RANK:-}}
if [[ -z $rank || -z ${PARATRAIN_RANK_LOGS:-} ]]; then
  echo "each_rank.sh: run it under mpirun from tests/fault/inject.sh (no rank or no PARATRAIN_RANK_LOGS)" >&2
  exit 2
fi
exec "$@" >"$PARATRAIN_RANK_LOGS/rank.$rank" 2>&1

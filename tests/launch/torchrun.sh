#!/usr/bin/env bash
# Runs PROGRAM under PyTorch's own torchrun (Debian's python3-torch: the elastic agent with its
# default, static rendezvous, whose store the agent itself serves at MASTER_ADDR:MASTER_PORT:
# Note [torchrun's store]) as NPROC ranks on this machine. Exits as the agent does (0 when every
# rank did); each rank's standard error is in the agent's log directory, printed on failure.
#
# Usage: torchrun.sh NPROC PROGRAM [ARGS...]
set -uo pipefail
(($# >= 2)) || { echo "usage: $0 NPROC PROGRAM [ARGS...]" >&2; exit 2; }
nproc=$1
shift
port=$(/usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
# 1.13's agent on Python 3.11: --redirects and --tee must be non-zero (its "0" parses to None
# and the agent dies): stdout is shown, stderr kept per rank in the log directory.
timeout -k 10 240 /usr/bin/python3 -m torch.distributed.run --nproc_per_node "$nproc" --master_addr 127.0.0.1 \
  --master_port "$port" --redirects 2 --tee 1 --log_dir "$logs" --no_python "$@"
status=$?
if ((status != 0)); then
  echo "torchrun.sh: torchrun exited with status $status; the ranks' standard error:" >&2
  find "$logs" -name 'stderr.log' -exec sh -c 'echo "== $1"; cat "$1"' _ {} \; >&2
fi
exit "$status"

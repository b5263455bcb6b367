#!/usr/bin/env bash
# A rank killed with SIGKILL in the middle of writing a checkpoint leaves the previous
# one loadable: real processes, a real kill.
#   kill_during_write.sh <mpirun.sh> <paratrain_tests> <scratch dir>
# The writer (2 ranks) saves an 8.4M-parameter model with Adam again and again, under DDP,
# ZeRO-2 or ZeRO-3 (PARATRAIN_CHECKPOINT_KILL_STRATEGY, default zero2);
# once a checkpoint exists and the next one's files are being written, rank 1 gets
# SIGKILL. Then 1 rank loads the newest complete checkpoint (every checksum checked).
set -euo pipefail
mpirun_sh=$1 tests=$2 dir=$3
rm -rf "$dir" && mkdir -p "$dir"
export PARATRAIN_CHECKPOINT_KILL_DIR=$dir
"$mpirun_sh" 2 "$tests" --no-skip --test-case="Checkpoint writer for the kill test" >"$dir/writer.log" 2>&1 &
writer=$!
# mpirun ends its ranks when it gets SIGTERM (SIGKILL would leave them running): the
# writer is stopped that way, and only killed if it has not ended 10 s later.
stop_writer() {
  kill -TERM "$writer" 2>/dev/null || return 0
  for _ in $(seq 100); do kill -0 "$writer" 2>/dev/null || return 0; sleep 0.1; done
  kill -KILL "$writer" 2>/dev/null
}
deadline=$((SECONDS + 240))
# Wait for a first complete checkpoint, then for the next one's data being written.
until [[ -f "$dir/ckpt/step-000000001/index.pt" ]]; do
  ((SECONDS < deadline)) || { echo "no first checkpoint in time"; cat "$dir/writer.log"; stop_writer; exit 1; }
  sleep 0.05
done
killed=""
while [[ -z "$killed" ]]; do
  ((SECONDS < deadline)) || { echo "never saw a write in progress"; stop_writer; exit 1; }
  for tmp in "$dir"/ckpt/.step-*.partial/rank-00001.bin.tmp; do
    if [[ -f "$tmp" ]]; then
      kill -9 "$(cat "$dir/pid-1")"
      killed=$tmp
      break
    fi
  done
  sleep 0.002
done
echo "SIGKILL to rank 1 while it wrote $killed"
wait $writer && { echo "the writer did not fail"; exit 1; }
ls -a "$dir/ckpt"
compgen -G "$dir/ckpt/.step-*.partial" >/dev/null || { echo "no partial checkpoint was left: the kill came too late"; exit 1; }
# The save killed was step N; the newest complete checkpoint must be N - 1's.
step=$(basename "$(dirname "$killed")")  # .step-00000000N.partial
step=${step#.step-}
export PARATRAIN_CHECKPOINT_KILLED_STEP=$((10#${step%.partial}))
"$mpirun_sh" 1 "$tests" --no-skip --test-case="Checkpoint after the kill test" --success
rm -rf "$dir"  # passed: the checkpoints go (a failure leaves them to look at)

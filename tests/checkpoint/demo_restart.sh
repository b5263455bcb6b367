#!/usr/bin/env bash
# The Fashion-MNIST demo stopped mid-run (SIGINT to mpirun, as Ctrl-C sends) and started
# again with the same command ends with the same test accuracy as an uninterrupted run.
#   demo_restart.sh <mpirun.sh> <fashion_mnist_ddp> <scratch dir>
set -euo pipefail
mpirun_sh=$1 demo=$2 dir=$3
rm -rf "$dir" && mkdir -p "$dir"
args=(--epochs 2 --train-samples 4096 --checkpoint-every 8)  # 32 steps an epoch at 2 ranks
accuracy() { grep -o '"test_accuracy": [0-9.]*' "$1"; }

"$mpirun_sh" 2 "$demo" "${args[@]}" --checkpoint-dir "$dir/whole" >"$dir/whole.log" 2>&1
want=$(accuracy "$dir/whole.log")

# Job control on: a background job then takes SIGINT, as a foreground one does from Ctrl-C.
set -m
"$mpirun_sh" 2 "$demo" "${args[@]}" --checkpoint-dir "$dir/ckpt" >"$dir/first.log" 2>&1 &
run=$!
# mpirun ends its ranks on SIGTERM, not on SIGKILL: a stuck run is stopped that way.
stop_run() {
  kill -TERM "$run" 2>/dev/null || return 0
  for _ in $(seq 100); do kill -0 "$run" 2>/dev/null || return 0; sleep 0.1; done
  kill -KILL -- "-$run" 2>/dev/null  # its process group (job control is on)
}
deadline=$((SECONDS + 240))
until [[ -f "$dir/ckpt/step-000000016/index.pt" ]]; do
  ((SECONDS < deadline)) || { echo "no checkpoint in time"; cat "$dir/first.log"; stop_run; exit 1; }
  sleep 0.02
done
kill -INT $run
wait $run || true
set +m
if accuracy "$dir/first.log" >/dev/null; then echo "the first run finished before it was stopped"; exit 1; fi
echo "stopped after $(ls "$dir/ckpt" | tr '\n' ' ')"

"$mpirun_sh" 2 "$demo" "${args[@]}" --checkpoint-dir "$dir/ckpt" >"$dir/second.log" 2>&1
grep 'resumed from' "$dir/second.log"
got=$(accuracy "$dir/second.log")
echo "uninterrupted: $want; stopped and resumed: $got"
[[ "$got" == "$want" ]]
rm -rf "$dir"  # passed: the checkpoints and logs go (a failure leaves them to look at)

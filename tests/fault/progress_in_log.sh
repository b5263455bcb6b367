#!/usr/bin/env bash
# progress_in_log.sh <mpiexec> <fashion_mnist_ddp>: the demo under mpirun with its output
# in a file, as a user with a terminal (TERM=xterm) would redirect it: the log holds
# readable lines only (no carriage returns or cursor codes), at most one progress line per
# log_every steps plus the epoch summaries. Note [Progress in logs].
set -euo pipefail
mpiexec=$1 demo=$2
log=$(mktemp)
trap 'rm -f "$log"' EXIT
TERM=xterm "$mpiexec" -n 2 "$demo" --epochs 1 --train-samples 12800 >"$log" 2>&1
cat "$log"
if grep -q $'\r\|\e' "$log"; then echo "progress_in_log: FAIL: the log holds terminal control codes"; exit 1; fi
# 12800 samples / (64 x 2) = 100 steps, log_every 200: no periodic line; header, epoch, summary, JSON.
lines=$(wc -l <"$log")
((lines <= 6)) || { echo "progress_in_log: FAIL: $lines lines, expected at most 6"; exit 1; }
echo "progress_in_log: $lines readable lines"

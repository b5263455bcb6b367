#!/usr/bin/env bash
# A time limit ends the run cleanly: exit 0, "stopped after step N: time limit", a complete
# checkpoint; the same command without the limit then resumes from it and finishes.
#
# Usage: check_time_limit.sh MPIRUN_WITH_NP_FLAG PROGRAM
set -uo pipefail
mpirun=$1 program=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
args=(--train-samples 2000 --epochs 1 --checkpoint-dir "$dir/ckpt")
out=$($mpirun 2 "$program" "${args[@]}" --time-limit 0.001 2>&1)
status=$?
echo "$out"
((status == 0)) || { echo "check_time_limit: the limited run exited with $status" >&2; exit 1; }
grep -Eq '^stopped after step [0-9]+: time limit$' <<<"$out" || { echo "check_time_limit: no 'stopped' line" >&2; exit 1; }
ls -d "$dir"/ckpt/step-* >/dev/null 2>&1 || { echo "check_time_limit: no checkpoint was saved" >&2; exit 1; }
out=$($mpirun 2 "$program" "${args[@]}" 2>&1)
status=$?
echo "$out"
((status == 0)) || { echo "check_time_limit: the resumed run exited with $status" >&2; exit 1; }
grep -q '^resumed from ' <<<"$out" || { echo "check_time_limit: the second run did not resume" >&2; exit 1; }
grep -q '^test accuracy ' <<<"$out" || { echo "check_time_limit: the second run did not finish" >&2; exit 1; }
echo "check_time_limit: passed"

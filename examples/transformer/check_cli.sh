#!/usr/bin/env bash
# The Transformer example's command line behaves like any Unix tool's (CLI11, as every
# example's): --help on stdout, once under mpirun, exit 0; a malformed or missing value
# fails, naming the option, on stderr; --name=value is accepted, and --steps is the
# older spelling of --max-steps.
#
# Usage: check_cli.sh SINGLE MPIRUN_WITH_NP_FLAG DDP
set -uo pipefail
single=$1 mpirun=$2 ddp=$3
small=(--d-model 32 --heads 2 --layers 1 --ff 32 --samples 64 --batch 8)
failed=0
out=$(mktemp) err=$(mktemp)
trap 'rm -f "$out" "$err"' EXIT
fail() { echo "check_cli: $*" >&2; failed=1; }

# expect STATUS STREAM REGEX -- COMMAND...: STATUS "0" or "nonzero"; REGEX must match a line of STREAM (out or err).
expect() {
  local status=$1 stream=$2 regex=$3
  shift 4
  "$@" >"$out" 2>"$err"
  local got=$?
  if [[ $status == 0 && $got != 0 ]] || [[ $status == nonzero && $got == 0 ]]; then
    fail "'$*' exited with $got (expected $status)"; cat "$out" "$err" >&2; return
  fi
  local file=$out
  [[ $stream == err ]] && file=$err
  grep -Eq -- "$regex" "$file" || { fail "'$*': no line of its std$stream matches $regex"; cat "$out" "$err" >&2; }
}

expect 0 out '^ *--max-steps,--steps' -- "$single" --help
[[ -s $err ]] && fail "--help wrote to stderr"
expect nonzero err '^--batch: takes a whole number, not .x.' -- "$single" --batch x
expect nonzero err '^--dropout' -- "$single" --dropout 0.5abc
expect nonzero err '--layers' -- "$single" --layers
expect nonzero err '^--lr-schedule' -- "$single" --lr-schedule exponential
expect 0 out '"steps": 2,' -- "$single" "${small[@]}" --steps=2
expect 0 out '"lr_schedule": "cosine"' -- "$single" "${small[@]}" --max-steps=3 --lr-schedule=cosine --lr-warmup=1
# Under mpirun: one help text from one rank, on stdout.
expect 0 out 'Usage:' -- $mpirun 2 "$ddp" --help
count=$(grep -c 'Usage:' "$out")
((count == 1)) || fail "mpirun -n 2 --help printed the usage $count times"
((failed == 0)) && echo "check_cli: passed"
exit "$failed"

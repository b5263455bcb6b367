#!/usr/bin/env bash
# Runs a transformer example (under mpirun or not) for ctest and passes only if it exits
# with 0 and its JSON summary line reports a finite loss. (ctest's PASS_REGULAR_EXPRESSION
# alone would ignore the exit status.)
#
# Usage: check_run.sh COMMAND [ARGS...]
set -uo pipefail
out=$(mktemp)
trap 'rm -f "$out"' EXIT
"$@" 2>&1 | tee "$out"
status=${PIPESTATUS[0]}
if ((status != 0)); then
  echo "check_run: the run failed with exit status $status" >&2
  exit "$status"
fi
summary=$(grep -E '^\{"example": "transformer"' "$out" | tail -n 1)
if [[ -z $summary ]]; then
  echo "check_run: no JSON summary line in the output" >&2
  exit 1
fi
# The program writes a loss that is not finite as null, so a finite one is a plain number.
if ! grep -qE '"loss": -?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?,' <<<"$summary"; then
  echo "check_run: the summary's loss is not a finite number: $summary" >&2
  exit 1
fi
echo "check_run: passed"

#!/usr/bin/env bash
# Runs a command for ctest and passes only if it exits with 0 AND a line of its output
# matches REGEX (an extended regular expression): ctest's PASS_REGULAR_EXPRESSION alone
# ignores the exit status, so a run that printed its summary and then crashed would pass.
#
# Usage: expect_output.sh REGEX -- COMMAND [ARGS...]
set -uo pipefail
regex=$1
shift
[[ ${1:-} == -- ]] && shift
out=$(mktemp)
trap 'rm -f "$out"' EXIT
"$@" 2>&1 | tee "$out"
status=${PIPESTATUS[0]}
if ((status != 0)); then
  echo "expect_output: the command failed with exit status $status" >&2
  exit "$status"
fi
if ! grep -Eq -- "$regex" "$out"; then
  echo "expect_output: no line of the output matches: $regex" >&2
  exit 1
fi
echo "expect_output: passed (exit 0, output matches $regex)"

#!/usr/bin/env bash
# Runs a transformer example (under mpirun or not) for ctest and passes only if it exits
# with 0 and its JSON summary line reports a finite loss (tests/support/expect_output.sh:
# ctest's PASS_REGULAR_EXPRESSION alone would ignore the exit status). The program writes a
# loss that is not finite as null, so a finite one is a plain number.
#
# Usage: check_run.sh COMMAND [ARGS...]
here=$(dirname "$0")
exec "$here/../../tests/support/expect_output.sh" \
  '^\{"example": "transformer".*"loss": -?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?,' -- "$@"

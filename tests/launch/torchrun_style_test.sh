#!/usr/bin/env bash
# The two torchrun-style launchers (tests/launch/torchrun_style.sh, used by the Gloo tests,
# and examples/launch/torchrun_style.sh, for users) export the variables torchrun does, pass
# a failing rank's status on, stop the other ranks, and do not wait forever.
# Usage: torchrun_style_test.sh SOURCE_DIR
set -uo pipefail
source_dir=$1
failures=0
fail() {
  echo "FAIL: $*" >&2
  failures=$((failures + 1))
}

# Exits non-zero in a rank whose variables are missing or inconsistent. Expanded by the
# rank's shell, not this one:
# shellcheck disable=SC2016
env_check='[[ $WORLD_SIZE == 3 && $LOCAL_WORLD_SIZE == 3 && $RANK =~ ^[0-2]$ && $LOCAL_RANK == "$RANK" &&
             -n $MASTER_ADDR && $MASTER_PORT =~ ^[0-9]+$ ]] || exit 9'
# Rank 1 fails after a moment; the others would sleep for five minutes. The odd duration
# marks our sleeps, to find any left running at the end.
marker="sleep 300.$$"
one_fails="if [[ \$RANK == 1 ]]; then sleep 0.5; exit 3; fi; exec $marker"

for launcher in "$source_dir/tests/launch/torchrun_style.sh" "$source_dir/examples/launch/torchrun_style.sh"; do
  name=${launcher#"$source_dir"/}
  echo "== $name"
  if ! "$launcher" 3 bash -c "$env_check"; then fail "$name: the ranks did not get RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT"; fi

  start=$SECONDS
  "$launcher" 3 bash -c "$one_fails"
  status=$?
  ((status == 3)) || fail "$name: a rank that exits with 3 should make the launcher exit with 3, not $status"
  ((SECONDS - start < 30)) || fail "$name: took $((SECONDS - start)) s to stop after a rank failed"
done

echo "== tests/launch/torchrun_style.sh --timeout"
start=$SECONDS
"$source_dir/tests/launch/torchrun_style.sh" --timeout 2 2 sleep "300.$$"
status=$?
((status == 124)) || fail "a run past --timeout should exit with 124, not $status"
((SECONDS - start < 30)) || fail "--timeout 2 took $((SECONDS - start)) s"

sleep 0.5
if pgrep -f "$marker" >/dev/null; then fail "a rank was left running: $(pgrep -af "$marker")"; fi
((failures == 0)) && echo "all launcher checks passed"
exit $((failures > 0))

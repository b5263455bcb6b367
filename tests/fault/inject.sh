#!/usr/bin/env bash
# inject.sh [--launcher-status-lost] <deadline s> <expected regexes> -- <launcher> ... <program> <args>
# Runs a faulty job under a deadline and checks what the user would: it ended before the
# deadline, with a non-zero status, saying what the regexes say (the rank or operation at
# fault; one per line, each must match a line of the output), leaving no process behind.
# Prints the time it took to fail.
# --launcher-status-lost: the launcher is known to exit 0 whatever its ranks did (Open MPI
# 4's mpirun with orte_enable_recovery, even after MPI_Abort(124)); the regexes must then
# show how the job ended, and only the status check is left out.
# Ranks started through tests/fault/each_rank.sh write to files of their own, in the folder
# $PARATRAIN_RANK_LOGS made here; each is added to the output after the job, its lines
# prefixed "[rank r] ", so every line the regexes see is one rank's, whole.
set -uo pipefail
status_lost=0
[[ $1 == --launcher-status-lost ]] && { status_lost=1; shift; }
deadline=$1 expect=$2
shift 2
[[ $1 == -- ]] && shift
log=$(mktemp)
PARATRAIN_RANK_LOGS=$(mktemp -d)
export PARATRAIN_RANK_LOGS
trap 'rm -rf "$log" "$PARATRAIN_RANK_LOGS"' EXIT
start=$(date +%s%N)
# SIGKILL after the deadline: a job that hangs fails the test instead of ctest's timeout.
# The job runs in a session of its own, whose id is $job: what it leaves behind is found by
# that id and ended by process id, never by name (under ctest -j another test may be running
# the same program).
setsid timeout -s KILL "$deadline" "$@" >"$log" 2>&1 &
job=$!
wait "$job"
status=$?
elapsed_ms=$((($(date +%s%N) - start) / 1000000))
for rank_log in "$PARATRAIN_RANK_LOGS"/rank.*; do
  [[ -e $rank_log ]] && sed "s/^/[rank ${rank_log##*.}] /" "$rank_log" >>"$log"
done
sed 's/^/  | /' "$log"
printf 'inject: ended in %d.%d s with status %d (deadline %d s)\n' $((elapsed_ms / 1000)) $((elapsed_ms % 1000 / 100)) "$status" "$deadline"
fail=0
if ((status == 137 && elapsed_ms >= deadline * 1000 - 500)); then
  echo "inject: FAIL: still running at the deadline (killed)"; fail=1
elif ((status == 0 && !status_lost)); then
  echo "inject: FAIL: the job exited 0 despite the fault"; fail=1
fi
while IFS= read -r pattern; do
  grep -Eq -- "$pattern" "$log" || { echo "inject: FAIL: no line matches: $pattern"; fail=1; }
done <<<"$expect"
if grep -Eq 'terminate called|Backtrace|\[ *[0-9]+\] .*\(\+0x' "$log"; then
  echo "inject: FAIL: a backtrace or 'terminate called' in the output"; fail=1
fi
sleep 0.5
# Exited processes not yet reaped (state Z) are gone already: only running ones count.
left=$(ps -o pid=,stat= -s "$job" | awk '$2 !~ /^Z/ { printf "%s ", $1 }')
if [[ -n ${left// /} ]]; then
  echo "inject: FAIL: processes left behind:"; ps -o pid,args -s "$job"
  # shellcheck disable=SC2086  # one pid per word
  kill -KILL $left 2>/dev/null
  fail=1
fi
exit $fail

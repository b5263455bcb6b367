#!/usr/bin/env bash
# Starts NPROC copies of a program on this machine as torchrun does, for the tests: each
# gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1 and a free
# MASTER_PORT. It never hangs and never leaves a rank behind:
# - the first rank that fails ends the run: the others are killed (TERM, then KILL after
#   5 s) and the exit status is the failing rank's;
# - past --timeout seconds every rank is killed and the status is 124;
# - when rank 0 could not listen because another process took the port between choosing
#   and binding it ("Address already in use"), the run is retried on a new port.
# Each rank's output is printed at the end, every line prefixed with "[rank r]".
#
# Usage: torchrun_style.sh [--timeout SECONDS] [--attempts N] NPROC PROGRAM [ARGS...]
set -uo pipefail

usage() { echo "usage: $0 [--timeout SECONDS] [--attempts N] NPROC PROGRAM [ARGS...]" >&2; }
timeout_s=600
attempts=3
while (($# > 0)); do
  case $1 in
    --timeout) timeout_s=$2; shift 2 ;;
    --attempts) attempts=$2; shift 2 ;;
    --) shift; break ;;
    -*) usage; exit 2 ;;
    *) break ;;
  esac
done
if (($# < 2)) || ! [[ $1 =~ ^[1-9][0-9]*$ && $timeout_s =~ ^[1-9][0-9]*$ && $attempts =~ ^[1-9][0-9]*$ ]]; then
  usage
  exit 2
fi
nproc=$1
shift

logs=$(mktemp -d "${TMPDIR:-/tmp}/torchrun_style.XXXXXX") || exit 1
pids=()

any_alive() {
  local pid
  for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && return 0; done
  return 1
}

# Ends every rank still running; only the processes this script started.
stop_ranks() {
  ((${#pids[@]} > 0)) || return 0
  local pid grace=$((SECONDS + 5))
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null; done
  while any_alive && ((SECONDS < grace)); do sleep 0.1; done
  for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null; done
  wait 2>/dev/null
  pids=()
}
trap 'stop_ranks; rm -rf "$logs"' EXIT
trap 'echo "torchrun_style.sh: interrupted; stopping the ranks" >&2; exit 130' INT TERM

# A port nobody listens on now: the kernel's choice through python3 when it is there,
# otherwise one derived from this shell's pid and $RANDOM (a collision is retried).
free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' \
    2>/dev/null || echo $((20000 + ($$ * 131 + RANDOM) % 40000))
}

print_logs() {
  local r
  for ((r = 0; r < nproc; r++)); do
    [[ -s $logs/rank$r.log ]] && sed "s/^/[rank $r] /" "$logs/rank$r.log"
  done
}

# One launch on port $1; sets status and failed (the first failing rank, or "").
run_once() {
  local port=$1 r
  shift
  for ((r = 0; r < nproc; r++)); do
    RANK=$r WORLD_SIZE=$nproc LOCAL_RANK=$r LOCAL_WORLD_SIZE=$nproc GROUP_RANK=0 \
      MASTER_ADDR=127.0.0.1 MASTER_PORT=$port "$@" >"$logs/rank$r.log" 2>&1 &
    pids+=($!)
  done
  local -a finished=()
  local remaining=$nproc deadline=$((SECONDS + timeout_s)) code
  status=0 failed=""
  while ((remaining > 0)); do
    for ((r = 0; r < nproc; r++)); do
      [[ -n ${finished[r]:-} ]] && continue
      kill -0 "${pids[r]}" 2>/dev/null && continue
      wait "${pids[r]}"
      code=$?
      finished[r]=1
      ((remaining--))
      if ((code != 0)) && [[ -z $failed ]]; then
        status=$code failed=$r
      fi
    done
    [[ -n $failed ]] && break
    if ((remaining > 0 && SECONDS >= deadline)); then
      status=124
      break
    fi
    ((remaining > 0)) && sleep 0.2
  done
  stop_ranks
}

for ((attempt = 1; attempt <= attempts; attempt++)); do
  port=$(free_port)
  echo "torchrun_style.sh: $nproc rank(s) of $1, MASTER_ADDR=127.0.0.1 MASTER_PORT=$port (attempt $attempt)"
  run_once "$port" "$@"
  if [[ -n $failed ]] && ((attempt < attempts)) && grep -qi "address already in use" "$logs/rank0.log"; then
    echo "torchrun_style.sh: port $port was taken before rank 0 could listen; retrying on another"
    continue
  fi
  break
done

print_logs
if [[ -n $failed ]]; then  # first: a rank may itself exit 124 (paratrain's watchdog does)
  echo "torchrun_style.sh: rank $failed exited with status $status; stopped the others" >&2
elif ((status == 124)); then
  echo "torchrun_style.sh: timed out after ${timeout_s} s; killed the ranks still running" >&2
fi
exit "$status"

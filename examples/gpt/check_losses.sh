#!/usr/bin/env bash
# Runs the GPT example under several layouts and passes only if every run's per-step losses
# (its "step k loss L" lines) agree with the first run's to a relative TOLERANCE: tensor
# parallelism at any degree, with or without sequence parallelism, trains the same model.
# Prints each run's losses side by side.
#
# Usage: check_losses.sh TOLERANCE COMMAND_1... [-- COMMAND_2...]...
set -uo pipefail
tolerance=$1
shift
runs=()
current=()
for arg in "$@"; do
  if [[ $arg == -- ]]; then runs+=("$(printf '%q ' "${current[@]}")"); current=(); else current+=("$arg"); fi
done
runs+=("$(printf '%q ' "${current[@]}")")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
i=0
for run in "${runs[@]}"; do
  echo "\$ $run"
  if ! eval "$run" >"$tmp/out.$i" 2>&1; then cat "$tmp/out.$i"; echo "check_losses: run $i failed"; exit 1; fi
  sed -n 's/^step \([0-9]*\) loss \(.*\)$/\2/p' "$tmp/out.$i" >"$tmp/loss.$i"
  [[ -s $tmp/loss.$i ]] || { cat "$tmp/out.$i"; echo "check_losses: run $i printed no losses"; exit 1; }
  i=$((i + 1))
done
paste "$tmp"/loss.* | awk -v t="$tolerance" '
  { line = "step " NR ":"; for (k = 1; k <= NF; ++k) line = line " " $k; print line
    for (k = 2; k <= NF; ++k) { d = $k - $1; if (d < 0) d = -d; m = $1 < 0 ? -$1 : $1
      if (d > t * m) { bad = 1; print "check_losses: run " k - 1 " differs at step " NR } } }
  END { if (bad) exit 1; print "check_losses: every run agrees to " t " relative" }'

#!/usr/bin/env bash
# Runs two programs that must train identically (the same samples, initial weights and
# replicas; dropout 0 where the two draw its masks differently) and passes only if each
# passes check_run.sh and their final losses agree to a relative TOLERANCE (0: the same
# printed number): a build of the transformer example against the plain-LibTorch reference
# (transformer_single --reference R), or against itself with another data path or with
# recomputation. float32 arithmetic in another order (stages, micro-batches, the replicas'
# reduction) differs by ~1e-6 relative after a few steps.
#
# Usage: compare_runs.sh TOLERANCE COMMAND_A... -- COMMAND_B...
set -uo pipefail
here=$(dirname "$0")
tolerance=$1
shift
a=()
while (($#)) && [[ $1 != -- ]]; do a+=("$1"); shift; done
shift
b=("$@")
loss_of() {
  local out
  out=$("$here/check_run.sh" "$@") || { echo "$out"; return 1; }
  echo "$out" >&2
  grep -E '^\{"example": "transformer"' <<<"$out" | tail -n 1 | sed -E 's/.*"loss": ([^,]*),.*/\1/'
}
la=$(loss_of "${a[@]}") || exit 1
lb=$(loss_of "${b[@]}") || exit 1
echo "compare_runs: loss $la against $lb (tolerance $tolerance relative)"
awk -v a="$la" -v b="$lb" -v t="$tolerance" 'BEGIN { d = a - b; if (d < 0) d = -d; m = a < 0 ? -a : a;
  if (d <= t * m) { print "compare_runs: passed"; exit 0 } print "compare_runs: the losses differ"; exit 1 }'

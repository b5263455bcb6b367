# Sourced by scripts/test.sh: `phase NAME COMMAND...` runs COMMAND and notes its wall time;
# `phases_report BUILD_DIR` prints the phases, then the ten slowest targets of BUILD_DIR's
# builds (.ninja_log: each target's last compile) and the ten slowest tests (ctest's cost data).
phases_table=""

phase() {
  local name=$1 start status=0
  shift
  start=$(date +%s%N)
  "$@" || status=$?
  phases_table+="$name"$'\t'"$((($(date +%s%N) - start) / 1000000))"$'\t'"$status"$'\n'
  return "$status"
}

phases_report() {
  local build=$1
  [[ -n $phases_table ]] || return 0
  echo
  echo "== phases (wall) =="
  printf '%s' "$phases_table" | awk -F'\t' '
    { s = $2 / 1000; total += s
      printf "%-14s %8.1f s%s\n", $1, s, ($3 == 0 ? "" : "  (failed: status " $3 ")") }
    END { printf "%-14s %8.1f s (%d min %02d s)\n", "total", total, int(total / 60), int(total) % 60 }'
  if [[ -f $build/.ninja_log ]]; then
    echo "== the ten slowest build targets ($build/.ninja_log) =="
    awk -F'\t' 'NR > 1 { t[$4] = ($2 - $1) / 1000 }
      END { for (k in t) printf "%8.1f s  %s\n", t[k], k }' "$build/.ninja_log" | sort -rn | awk 'NR <= 10'
    awk -F'\t' 'NR > 1 { t[$4] = ($2 - $1) / 1000 } END { for (k in t) { s += t[k]; n++ }
      printf "%8.1f s  all %d targets, summed\n", s, n }' "$build/.ninja_log"
  fi
  local cost=$build/Testing/Temporary/CTestCostData.txt
  if [[ -f $cost ]]; then
    echo "== the ten slowest tests ($cost) =="
    awk '/^---/ { exit } NF == 3 { printf "%8.1f s  %s\n", $3, $1 }' "$cost" | sort -rn | awk 'NR <= 10'
  fi
}

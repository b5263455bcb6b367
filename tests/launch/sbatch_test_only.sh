#!/usr/bin/env bash
# Asks SLURM to validate a batch script without running it (sbatch --test-only), where
# SLURM is installed; elsewhere exits 77, which ctest reports as skipped.
# Usage: sbatch_test_only.sh SCRIPT
set -euo pipefail
script=$1
if ! command -v sbatch >/dev/null 2>&1; then
  echo "skipped: sbatch is not installed here (no SLURM client), so $script is checked only by bash -n"
  exit 77
fi
# --test-only prints when and where the job would start, and fails on a directive the
# cluster cannot satisfy (partition, gres, node count).
sbatch --test-only "$script"

#!/usr/bin/env bash
# Mixed precision and activation checkpointing on the Transformer example, side by side:
# examples/transformer's transformer_ddp in fp32, with --recompute (paratrain::Recompute
# around every encoder and decoder layer), with --bf16 (forward under bf16 autocast,
# gradients summed in bf16) and with both, beside the PyTorch DDP reference program (benchmarks/transformer_vs_torch.py) doing the
# same (torch.utils.checkpoint(use_reentrant=False) around the same layers;
# torch.autocast("cpu", torch.bfloat16); its DDP sums gradients in fp32, since PyTorch
# 1.13's bf16_compress_hook needs NCCL and this machine has gloo), 2 ranks each, batch
# 32 per rank, Adam; at the reference's target length (20) and at a longer one (100, where
# activations weigh more). Prints each run's step time, its peak memory (the largest
# resident set of any rank's process, which includes the model state, ~700 MiB, and the
# data) and paratrain's bytes of gradients sent per step and rank (measured:
# DataParallel::gradient_bytes_sent), then what each option costs and saves on each side.
# Builds nothing: cmake --build build --target transformer_ddp.
#
# Usage: benchmarks/memory_vs_torch.sh [steps in all, 8] [warm-up steps left out of the timing, 2]
# Needs python3-torch, jq and /usr/bin/time (PARATRAIN_WITH_PEER=1 scripts/deps.sh).
#
# Both sides: one intra-op thread per rank, rank r pinned to core r, and the same glibc
# allocator settings, set here for both: MALLOC_MMAP_THRESHOLD_=67108864
# MALLOC_TRIM_THRESHOLD_=2147483647 (paratrain's defaults, Note [Allocator]): freed heap
# memory is kept, so the peak resident set is the peak of what was allocated at once.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-8}
warmup=${2:-2}
build=${PARATRAIN_BUILD_DIR:-build-bench}
bench=$build/examples/transformer_ddp
python=/usr/bin/python3
. benchmarks/side_by_side.sh  # require_built, same_environment, run_clean, machine_line
require_built "$build" transformer_ddp
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
same_environment "$0" "$steps" "$warmup"
export RUN_CLEAN_TRIES=3
# target length, samples (enough for the steps at 2 x 32 a step)
for config in "20 2048" "100 512"; do
  read -r tgt samples <<<"$config"
  for variant in plain recompute bf16 bf16+recompute; do
    flag=()
    [[ $variant == *recompute* ]] && flag+=(--recompute)
    [[ $variant == bf16* ]] && flag+=(--bf16)
    echo "-- target length $tgt, $variant" >&2
    run_clean scripts/mpirun.sh 2 "$bench" --steps "$steps" --warmup "$warmup" --tgt-len "$tgt" --samples "$samples" \
      "${flag[@]}"
    run_clean "$python" benchmarks/transformer_vs_torch.py --ranks 2 --steps "$steps" --warmup "$warmup" --bind \
      --tgt-len "$tgt" --samples "$samples" "${flag[@]}"
  done
done

jq -rs -L benchmarks 'include "table";
  def run(s; t; r; b): map(select(side == s and .tgt_len == t and .recompute == r and .bf16 == b)) | .[0];
  def name(r; b): (if b then "bf16" else "fp32" end) + (if r then ", recomputed" else "" end);
  def pct(x): (if x >= 0 then "+" else "" end) + (100 * x | f(1)) + "%";
  . as $all
  | "| target length | precision, activations | paratrain ms/step | peak MiB | gradients sent MiB/step | PyTorch ms/step | peak MiB | torch/paratrain time |",
    "|---:|---|---:|---:|---:|---:|---:|---:|",
    ([20, 100][] as $t | [false, true][] as $b | [false, true][] as $r
      | ($all | run("paratrain"; $t; $r; $b)) as $o | ($all | run("pytorch"; $t; $r; $b)) as $p
      | "| \($t) | \(name($r; $b)) | \($o.ms_per_step | f(1)) | \($o.peak_rss_mib_max | f(0))"
        + " | \($o.gradient_bytes_sent / 1048576 | f(1)) | \($p.ms_per_step | f(1)) | \($p.peak_rss_mib_max | f(0))"
        + " | \($p.ms_per_step / $o.ms_per_step | f(2))× |"),
    "",
    "| target length | side | recomputing: time | recomputing: peak memory | bf16: time | bf16: peak memory |",
    "|---:|---|---:|---:|---:|---:|",
    ([20, 100][] as $t | ["paratrain", "pytorch"][] as $s
      | ($all | run($s; $t; false; false)) as $k | ($all | run($s; $t; true; false)) as $c
      | ($all | run($s; $t; false; true)) as $h
      | "| \($t) | \($s) | \(pct(($c.ms_per_step - $k.ms_per_step) / $k.ms_per_step))"
        + " | \($c.peak_rss_mib_max - $k.peak_rss_mib_max | f(0)) MiB"
        + " | \(pct(($h.ms_per_step - $k.ms_per_step) / $k.ms_per_step))"
        + " | \($h.peak_rss_mib_max - $k.peak_rss_mib_max | f(0)) MiB |"),
    "",
    "ms/step: the slowest rank'"'"'s mean over \($all[0].steps - $all[0].warmup) timed steps after \($all[0].warmup) warm-up"
    + " steps, 2 ranks, batch 32 per rank, one round. Peak: the largest peak resident set of any rank'"'"'s process."
    + " Others'"'"' CPU during each run: \(map(.others_cpu) | max) of a core at most."
' "$tmp/results"
echo
echo "Command: $command"
machine_line

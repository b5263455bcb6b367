#!/usr/bin/env bash
# Runs a benchmark side by side with its reference and prints the table.
# Usage: scripts/bench.sh allreduce | sharding_collectives | all_to_all | context_attention | ddp_vs_torch | zero | zero_memory | memory_breakdown | hooks | zero_progress | transformer_memory | fit_loop | deterministic | checkpoint | pipeline | transformer | io | memory | fashion_mnist | checkpoint_cost | elastic_restart | moe
set -euo pipefail
cd "$(dirname "$0")/.."
# The benchmarks' own build, at -O3 (the tests' build/ is at -O0: scripts/build.sh).
export PARATRAIN_BUILD_DIR=${PARATRAIN_BUILD_DIR:-build-bench} PARATRAIN_OPT=${PARATRAIN_OPT:--O3}
build=$PARATRAIN_BUILD_DIR
case "${1:-}" in
  allreduce)
    scripts/build.sh --target bench_allreduce >&2
    scripts/mpirun.sh 2 "$build/benchmarks/bench_allreduce" ;;
  all_to_all)
    scripts/build.sh --target bench_all_to_all >&2
    shift
    scripts/mpirun.sh 2 "$build/benchmarks/bench_all_to_all" "$@" ;;
  context_attention)
    # The context group the whole world: cp = 1, 2 and 4 (4 ranks on 2 cores share them:
    # its memory is what it keeps, its times are not a 4-core machine's).
    scripts/build.sh --target bench_context_attention >&2
    shift
    for ranks in 1 2 4; do scripts/mpirun.sh "$ranks" "$build/benchmarks/bench_context_attention" "$@"; done ;;
  sharding_collectives)
    scripts/build.sh --target bench_reduce_scatter bench_all_gather >&2
    scripts/mpirun.sh 2 "$build/benchmarks/bench_reduce_scatter"
    scripts/mpirun.sh 2 "$build/benchmarks/bench_all_gather" ;;
  ddp_vs_torch)
    PARATRAIN_WITH_PEER=1 scripts/deps.sh
    scripts/build.sh --target bench_ddp_vs_torch >&2
    benchmarks/ddp_vs_torch.sh ;;
  zero)
    PARATRAIN_WITH_PEER=1 scripts/deps.sh
    scripts/build.sh --target bench_zero >&2
    shift
    benchmarks/zero_vs_torch.sh "$@" ;;
  zero_progress)
    scripts/deps.sh
    scripts/build.sh --target bench_zero >&2
    shift
    benchmarks/zero_progress.sh "$@" ;;
  transformer_memory)
    scripts/deps.sh
    scripts/build.sh --target transformer_ddp transformer_zero3 >&2
    shift
    benchmarks/transformer_memory.sh "$@" ;;
  fit_loop)
    scripts/deps.sh
    scripts/build.sh --target transformer_ddp >&2
    shift
    benchmarks/fit_loop.sh "$@" ;;
  deterministic)
    scripts/deps.sh
    scripts/build.sh --target bench_deterministic >&2
    shift
    benchmarks/deterministic.sh "$@" ;;
  zero_memory)
    scripts/deps.sh
    scripts/build.sh --target bench_zero >&2
    shift
    benchmarks/zero_memory.sh "$@" ;;
  memory_breakdown)
    PARATRAIN_WITH_PEER=1 scripts/deps.sh  # jq, libjemalloc2
    scripts/build.sh --target bench_zero >&2
    shift
    benchmarks/memory_breakdown.sh "$@" ;;
  hooks)
    PARATRAIN_WITH_PEER=1 scripts/deps.sh
    scripts/build.sh --target bench_ddp_vs_torch >&2
    shift
    benchmarks/hooks_vs_torch.sh "$@" ;;
  checkpoint)
    PARATRAIN_WITH_PEER=1 scripts/deps.sh
    scripts/build.sh --target bench_checkpoint >&2
    benchmarks/checkpoint_vs_torch.sh ;;
  pipeline)
    scripts/build.sh --target bench_pipeline >&2
    scripts/mpirun.sh 2 "$build/benchmarks/bench_pipeline" "${@:2}" ;;
  transformer)
    PARATRAIN_WITH_PEER=1 scripts/deps.sh
    scripts/build.sh --target transformer_ddp >&2
    benchmarks/transformer_vs_torch.sh "${@:2}" ;;
  io)
    PARATRAIN_WITH_PEER=1 scripts/deps.sh
    scripts/build.sh --target transformer_ddp transformer_single >&2
    benchmarks/io_vs_torch.sh "${@:2}" ;;
  memory)
    PARATRAIN_WITH_PEER=1 scripts/deps.sh
    scripts/build.sh --target transformer_ddp >&2
    benchmarks/memory_vs_torch.sh "${@:2}" ;;
  fashion_mnist)
    PARATRAIN_WITH_PEER=1 scripts/deps.sh
    scripts/build.sh --target fashion_mnist_ddp >&2
    benchmarks/fashion_mnist_vs_torch.sh ;;
  checkpoint_cost)
    scripts/deps.sh
    scripts/build.sh --target transformer_ddp >&2
    shift
    benchmarks/checkpoint_cost.sh "$@" ;;
  moe)
    scripts/deps.sh
    scripts/build.sh --target gpt_ddp gpt_zero3 >&2
    shift
    benchmarks/moe.sh "$@" ;;
  elastic_restart)
    PARATRAIN_WITH_PEER=1 scripts/deps.sh  # torchrun: python3-torch
    scripts/build.sh --target transformer_ddp fashion_mnist_ddp_gloo elastic_train bench_elastic_transformer >&2
    shift
    /usr/bin/python3 benchmarks/elastic_restart.py "$build" "$@" ;;
  *)
    echo "usage: scripts/bench.sh allreduce | sharding_collectives | all_to_all | context_attention | ddp_vs_torch | zero | zero_memory | memory_breakdown | hooks | zero_progress | transformer_memory | fit_loop | deterministic | checkpoint | pipeline | transformer | io | memory | fashion_mnist | checkpoint_cost | elastic_restart | moe" >&2
    exit 2 ;;
esac

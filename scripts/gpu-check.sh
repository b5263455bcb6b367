#!/usr/bin/env bash
# The GPU check: anyone with an NVIDIA GPU and a CUDA build of PyTorch can run it (docs/gpu.md).
#
#  1. builds paratrain against the LibTorch inside that PyTorch (torch.utils.cmake_prefix_path),
#     with NCCL from its install (the nvidia-nccl wheel, else the CUDA toolkit's) and Gloo
#     from its c10d; MPI only where there is one; the header-only dependencies (range-v3,
#     doctest, nlohmann-json, CLI11) from the system or from a folder scripts/gpu-deps.sh
#     prepared on a Debian machine (default .gpu-deps/);
#  2. runs the equivalence suite on CUDA (tests/gpu/): one process, and two processes sharing
#     the GPU over Gloo with CUDA tensors, each also over NCCL alone, and over NCCL across
#     the processes where there are as many GPUs;
#  3. trains the demo on the GPU (fashion_mnist_single, and fashion_mnist_ddp_nccl);
#  4. runs the GPU benchmarks side by side with PyTorch on the same GPU, in this run:
#     Fashion-MNIST time to 90% and steps/s (fashion_mnist_single against
#     benchmarks/fashion_mnist_vs_torch.py, one process each), and the Transformer's bf16
#     step time with its MFU (transformer_single --bf16 against transformer_vs_torch.py --bf16),
#     and bench_zero's models at every ZeRO stage over NCCL (bench_zero_rendezvous against
#     zero_vs_torch.py --device cuda: DDP, ZeroRedundancyOptimizer, FSDP), steps/s and peak memory;
#     and, on two GPUs, tensor parallelism at t = 2 with and without sequence parallelism
#     (bench_tensor_parallel_rendezvous against tensor_parallel_vs_dtensor.py --device cuda);
#  5. prints one summary table (and writes it, with every log, to $out).
#
# Both sides run with the same allocator settings: glibc's MALLOC_MMAP_THRESHOLD_=67108864
# MALLOC_TRIM_THRESHOLD_=2147483647 (paratrain's own, Note [Allocator]) for host memory, and
# CUDA's caching allocator at its defaults (PYTORCH_CUDA_ALLOC_CONF unset) on the device.
#
# Without a GPU it still builds everything it finds (NCCL too, where CMake finds CUDA), runs the
# suite's checks on the CPU (PARATRAIN_TEST_DEVICE=cpu) and reports the GPU parts as not run.
#
# Usage: scripts/gpu-check.sh [--quick] [--suite]
#   --quick: 1 epoch and fewer steps, for a smoke run
#   --suite: step 2 alone (builds the suite's one program: about 2 minutes of a 16-core machine's
#            time where the whole check takes 4.5), for a short lease of a GPU
# Environment: PYTHON (python3), PARATRAIN_GPU_DEPS (.gpu-deps), PARATRAIN_GPU_BUILD (build-gpu),
#   PARATRAIN_TORCH_PREFIX (another LibTorch than the one inside that PyTorch, which the
#   benchmarks still need), PARATRAIN_GPU_MPI (ON, OFF or AUTO: with or without MPI; default:
#   AUTO, where MPI and Boost.MPI are both found), PARATRAIN_PEAK_TFLOPS (the GPU's dense
#   bf16 peak, where the table below does not know the GPU), PARATRAIN_FASHION_MNIST (the data).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
deps=$(realpath -m "${PARATRAIN_GPU_DEPS:-.gpu-deps}")
build=$(realpath -m "${PARATRAIN_GPU_BUILD:-build-gpu}")
out=$build/gpu-check
quick=0 suite_only=0
for arg in "$@"; do
  case $arg in
    --quick) quick=1 ;;
    --suite) suite_only=1 ;;
    *) echo "gpu-check: unknown option '$arg' (usage: scripts/gpu-check.sh [--quick] [--suite])" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
export MALLOC_MMAP_THRESHOLD_=67108864 MALLOC_TRIM_THRESHOLD_=2147483647
unset PYTORCH_CUDA_ALLOC_CONF
say() { printf 'gpu-check: %s\n' "$*" >&2; }

# ---- 1. what this machine has ---------------------------------------------------------------
probe=$("$python" - <<'EOF'
import os, shlex
import torch
def put(k, v): print(f"{k}={shlex.quote(str(v))}")
put("torch_prefix", torch.utils.cmake_prefix_path)
put("torch_dir", os.path.dirname(torch.__file__))
put("torch_version", torch.__version__)
put("torch_cuda", torch.version.cuda or "")
put("gpus", torch.cuda.device_count())
put("gpu_name", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
nccl = ""
try:
    import nvidia.nccl
    nccl = list(nvidia.nccl.__path__)[0]
except Exception:
    pass
put("wheel_nccl", nccl)
EOF
) || { say "$python cannot import torch: this check builds against a CUDA build of PyTorch (PYTHON names another)"; exit 1; }
eval "$probe"

torch_prefix=${PARATRAIN_TORCH_PREFIX:-$torch_prefix}
say "PyTorch $torch_version (CUDA ${torch_cuda:-none}), $gpus GPU(s)${gpu_name:+: $gpu_name}; LibTorch from $torch_prefix"

cmake_args=(-G Ninja -DCMAKE_BUILD_TYPE=Release "-DCMAKE_CXX_FLAGS_RELEASE=-O2 -DNDEBUG"
            "-DCMAKE_PREFIX_PATH=$torch_prefix;$deps/usr;$deps/usr/lib/x86_64-linux-gnu/cmake;$deps/usr/share"
            -DPARATRAIN_WITH_HDF5=OFF -DPARATRAIN_BUILD_BENCHMARKS=ON -DPARATRAIN_BUILD_TOOLS=OFF)
# NCCL: the wheel's (the one PyTorch itself loads), else whatever CMake finds (the toolkit's).
if [[ -n $wheel_nccl && -f $wheel_nccl/include/nccl.h ]]; then
  lib=$(ls "$wheel_nccl"/lib/libnccl.so* | head -n 1)
  cmake_args+=("-DPARATRAIN_NCCL_INCLUDE_DIR=$wheel_nccl/include" "-DPARATRAIN_NCCL_LIBRARY=$lib")
  export LD_LIBRARY_PATH=$wheel_nccl/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
((gpus > 0)) && cmake_args+=(-DPARATRAIN_WITH_NCCL=ON)
# Gloo's headers: LibTorch's own where it ships them, else Debian's from the folder.
if [[ -f $torch_dir/include/gloo/context.h ]]; then
  cmake_args+=("-DPARATRAIN_GLOO_INCLUDE_DIR=$torch_dir/include")
elif [[ -f $deps/usr/include/gloo/context.h ]]; then
  cmake_args+=("-DPARATRAIN_GLOO_INCLUDE_DIR=$deps/usr/include")
fi
mpi=${PARATRAIN_GPU_MPI:-AUTO}  # AUTO: where MPI and Boost.MPI are both found (an mpicxx alone is not enough)
cmake_args+=("-DPARATRAIN_WITH_MPI=$mpi")
export LD_LIBRARY_PATH=$torch_dir/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

say "configuring in $build"
cmake -S . -B "$build" "${cmake_args[@]}" >"$out/configure.log" 2>&1 || { tail -30 "$out/configure.log" >&2; exit 1; }
grep -E '^-- paratrain:' "$out/configure.log" | sed 's/^-- /gpu-check: /' >&2 || true
targets=(paratrain_gloo_tests fashion_mnist_single transformer_single bench_zero_rendezvous bench_tensor_parallel_rendezvous)
grep -q 'paratrain::nccl with' "$out/configure.log" && targets+=(fashion_mnist_ddp_nccl)
((suite_only)) && targets=(paratrain_gloo_tests)
grep -q 'paratrain::gloo with' "$out/configure.log" || { say "no paratrain::gloo (c10d Gloo or its headers missing): run scripts/gpu-deps.sh"; exit 1; }
start=$(date +%s)
# -k 0: every target that can be built is, so that one run names every error (the generator is Ninja).
cmake --build "$build" -j "$(nproc)" --target "${targets[@]}" -- -k 0 >"$out/build.log" 2>&1 ||
  { grep -E 'error|FAILED' "$out/build.log" | head -60 >&2; exit 1; }
say "built ${targets[*]} in $(($(date +%s) - start)) s"

# ---- 2. the equivalence suite on CUDA ---------------------------------------------------------
rows=()
row() { rows+=("$(printf '%-44s %-22s %-16s %s' "$@")"); }
suite_cases="[gpu]*"  # the suite's cases a row runs (doctest's --test-case filter)
suite_exclude=""      # and those it leaves to a row of their own (--test-case-exclude)
suite() {  # $1: processes; the rest: environment
  local n=$1 log=$out/suite.np$1${suite_log:-}.log
  shift
  if env "$@" OMP_NUM_THREADS=1 tests/launch/torchrun_style.sh --timeout 900 "$n" "$build/tests/paratrain_gloo_tests" \
       --requires-gpu "--test-case=$suite_cases" ${suite_exclude:+"--test-case-exclude=$suite_exclude"} >"$log" 2>&1; then
    # A case that cannot run here prints "skipped: why" once (tests/gpu/gpu_support.hpp) and
    # counts as passed in doctest's summary: counted apart (rank 0's lines), so that none hides.
    local cases skipped
    cases=$(grep -a -m1 -oE 'test cases: +[0-9]+ \| +[0-9]+ passed' "$log" | grep -oE '[0-9]+ passed$' |
      grep -oE '^[0-9]+' || true)
    skipped=$(grep -a '^\[rank 0\]' "$log" | grep -c 'skipped: ' || true)
    echo "$((${cases:-0} - skipped)) passed, $skipped skipped"
  else
    local rc=$?
    # 77: the suite saw no GPU. Where PyTorch sees one, that is a failure (a LibTorch without
    # CUDA was linked, say), not a skip: no case ran.
    ((rc == 77 && gpus == 0)) && echo "skipped (no GPU)" || echo "FAILED (see $log)"
  fi
}
failed=0
check_suite() {  # $1: the row's name, $2: its note, the rest: suite's arguments
  local name=$1 note=$2 result
  shift 2
  result=$(suite "$@")
  [[ $result == FAILED* ]] && failed=1
  row "$name" "$result" "" "$note"
}
if ((gpus > 0)); then
  check_suite "equivalence on CUDA, 1 process" "Gloo, NCCL alone" 1
  suite_exclude="[gpu] tensor parallelism*" check_suite "equivalence on CUDA, 2 processes" \
    "$( ((gpus >= 2)) && echo "Gloo, NCCL alone and across" || echo "sharing the GPU: Gloo, NCCL alone")" 2
  # Tensor parallelism at t = 2 (sequence-parallel, dropout on) against the single-device
  # model: over Gloo with the processes sharing a GPU, over NCCL where each has its own
  # (NCCL takes no two ranks on one GPU). Left out of the run above, counted here.
  suite_cases="[gpu] tensor parallelism*" suite_log=.tensor_parallel \
    check_suite "tensor parallelism on CUDA, t = 2" \
    "$( ((gpus >= 2)) && echo "Gloo sharing a GPU, NCCL across two" || echo "Gloo sharing the GPU; NCCL needs 2 GPUs")" 2
else
  check_suite "equivalence, the suite's checks on the CPU" "no GPU: not on CUDA" 2 PARATRAIN_TEST_DEVICE=cpu
fi

# The table (step 5) and the check's status: at the end, or here with --suite.
table_and_exit() {
  {
    echo "paratrain GPU check, $(date -u +%Y-%m-%dT%H:%MZ): ${gpu_name:-no GPU} x $gpus, PyTorch $torch_version, CUDA ${torch_cuda:-none}"
    printf '%-44s %-22s %-16s %s\n' "" "paratrain" "PyTorch" ""
    printf '%s\n' "${rows[@]}"
    echo "host allocator: MALLOC_MMAP_THRESHOLD_=67108864 MALLOC_TRIM_THRESHOLD_=2147483647 on both sides; CUDA caching allocator defaults"
  } | tee "$out/summary.txt"
  exit "$failed"
}
if ((suite_only)); then
  row "the demo and the benchmarks" "not run" "" "--suite: the equivalence suite alone"
  table_and_exit
fi

# ---- 3, 4. the demo and the benchmarks, side by side --------------------------------------------
data=${PARATRAIN_FASHION_MNIST:-}
for d in "$data" /usr/share/datasets/fashion-mnist "$deps/usr/share/datasets/fashion-mnist"; do
  [[ -n $d && -f $d/train-images-idx3-ubyte.gz ]] && { data=$d; break; }
done
# The last JSON line of a log, rank 0's under a launcher that tags lines ("" where there is
# none: the row then shows empty fields).
json() { sed 's/^\[rank 0\] //' "$1" | grep -a '^{' | tail -n 1 || true; }
field() { "$python" -c 'import json,sys; v=json.loads(sys.argv[1]).get(sys.argv[2]); print("" if v is None else v)' "$1" "$2" 2>/dev/null || true; }
millions() { awk -v n="$1" 'BEGIN { if (n != "") printf "%.1fM", n / 1e6 }'; }
ratio() { "$python" -c 'import sys; a,b=map(float,sys.argv[1:3]); print(f"{a/b:.2f}x")' "$1" "$2" 2>/dev/null || echo "-"; }
if ((gpus == 0)); then
  row "Fashion-MNIST, Transformer, MFU" "not run" "" "no GPU visible to PyTorch"
elif [[ -z $data ]]; then
  row "Fashion-MNIST time to 90%" "not run" "" "no data: install dataset-fashion-mnist or run gpu-deps.sh"
else
  epochs=$((quick ? 1 : 5))
  # A run that fails marks the check failed and leaves its row empty; the table still comes.
  "$build/examples/fashion_mnist_single" --device cuda --epochs "$epochs" --data "$data" \
    >"$out/fashion_paratrain.log" 2>&1 || failed=1
  "$python" benchmarks/fashion_mnist_vs_torch.py --ranks 1 --device cuda --epochs "$epochs" --data "$data" \
    >"$out/fashion_pytorch.log" 2>&1 || failed=1
  p=$(json "$out/fashion_paratrain.log") t=$(json "$out/fashion_pytorch.log")
  row "Fashion-MNIST CNN, samples/s (batch 64)" "$(field "$p" samples_per_second)" "$(field "$t" samples_per_second)" \
      "paratrain/PyTorch $(ratio "$(field "$p" samples_per_second)" "$(field "$t" samples_per_second)") (goal >= 1.2x)"
  row "Fashion-MNIST, seconds to 90% test acc." "$(field "$p" seconds_to_90)" "$(field "$t" seconds_to_90)" \
      "final accuracy $(field "$p" test_accuracy) / $(field "$t" test_accuracy)"
  if [[ -x $build/examples/fashion_mnist_ddp_nccl ]]; then
    n=$((gpus >= 2 ? 2 : 1))
    tests/launch/torchrun_style.sh --timeout 900 "$n" "$build/examples/fashion_mnist_ddp_nccl" --epochs "$epochs" \
      --data "$data" >"$out/fashion_nccl.log" 2>&1 || failed=1
    q=$(json "$out/fashion_nccl.log")
    row "demo over NCCL, $n GPU(s)" "$(field "$q" test_accuracy)" "" "test accuracy after $epochs epochs"
  fi
fi
if ((gpus > 0)); then
  steps=$((quick ? 8 : 40)) warmup=$((quick ? 3 : 10))
  common=(--batch 64 --samples 4096 --steps "$steps" --warmup "$warmup" --bf16)
  "$build/examples/transformer_single" --device cuda "${common[@]}" >"$out/transformer_paratrain.log" 2>&1 || failed=1
  "$python" benchmarks/transformer_vs_torch.py --ranks 1 --device cuda "${common[@]}" \
    >"$out/transformer_pytorch.log" 2>&1 || failed=1
  p=$(json "$out/transformer_paratrain.log") t=$(json "$out/transformer_pytorch.log")
  pm=$(field "$p" ms_per_step) tm=$(field "$t" ms_per_step) params=$(field "$p" parameters)
  # MFU: model FLOPs per second over the GPU's dense bf16 peak. Model FLOPs per step: 6 per
  # parameter per token (forward 2, backward 4), tokens = batch x (source 1 + target 20).
  peak=${PARATRAIN_PEAK_TFLOPS:-$("$python" - "$gpu_name" <<'EOF'
import sys
name = sys.argv[1]
for key, tflops in [("H200", 989.4), ("H100 PCIe", 756.0), ("H100", 989.4), ("A100", 312.0), ("L40S", 362.1),
                    ("A10", 125.0), ("L4", 121.0), ("V100", 125.0), ("T4", 65.0)]:
    if key in name:
        print(tflops)
        break
EOF
)}
  mfu() { "$python" -c 'import sys; p,ms,peak=map(float,sys.argv[1:4]); print(f"{100*6*p*64*21/(ms/1e3)/(peak*1e12):.2f}%")' "$params" "$1" "$peak" 2>/dev/null || echo "-"; }
  row "Transformer bf16 step, ms (batch 64)" "$pm" "$tm" "paratrain/PyTorch $(ratio "$pm" "$tm") (goal <= 1.00x)"
  row "Transformer bf16 MFU (peak ${peak:-?} TFLOP/s)" "$(mfu "$pm")" "$(mfu "$tm")" "$params parameters"
fi
# bench_zero's models (16.8M and 50.4M parameters, Adam, batch 32 per rank) on the GPUs over
# NCCL, one rank per GPU (NCCL allows no two on one), beside PyTorch's DDP,
# ZeroRedundancyOptimizer and FSDP (fully_shard per Linear: ZeRO-3's peer) on the same GPUs;
# paratrain's ZeRO-2 has no PyTorch peer. Peak memory: CUDA's caching allocator's, both sides.
if ((gpus > 0)) && grep -q 'paratrain::nccl with' "$out/configure.log"; then
  steps=$((quick ? 9 : 60))
  for layers in 4 12; do
    for strategy in ddp zero1 zero2 zero3; do
      log=$out/zero_${strategy}_$layers
      tests/launch/torchrun_style.sh --timeout 900 "$gpus" "$build/benchmarks/bench_zero_rendezvous" --device cuda \
        --strategy "$strategy" --layers "$layers" --steps "$steps" >"$log.paratrain.log" 2>&1 || failed=1
      case $strategy in ddp | zero1) peer=$strategy ;; zero3) peer=fsdp ;; *) peer="" ;; esac
      t=""
      if [[ -n $peer ]]; then
        "$python" benchmarks/zero_vs_torch.py --device cuda --ranks "$gpus" --mode "$peer" --layers "$layers" \
          --steps "$steps" >"$log.pytorch.log" 2>&1 || failed=1
        t=$(json "$log.pytorch.log")
      fi
      p=$(json "$log.paratrain.log")
      ps=$(field "$p" steps_per_s) ts=$(field "$t" steps_per_s) size=$(field "$p" parameters)
      if [[ -n $peer ]]; then
        versus="vs PyTorch $peer: $(ratio "$ps" "$ts"); peak GPU MiB $(field "$p" peak_gpu_mib) / $(field "$t" peak_gpu_mib)"
      else
        versus="no PyTorch peer; peak GPU MiB $(field "$p" peak_gpu_mib)"
      fi
      row "bench_zero $(millions "$size") $strategy, steps/s" "$ps" "${ts:--}" \
          "$versus; model states $(field "$p" held_mib) MiB; $gpus GPU(s)"
    done
  done
else
  row "bench_zero's models" "not run" "" "$( ((gpus > 0)) && echo "no paratrain::nccl" || echo "no GPU visible to PyTorch")"
fi

# Tensor parallelism at t = 2 beside PyTorch's DTensor (parallelize_module, Colwise/Rowwise;
# torchtitan's sequence-parallel plan), both over NCCL with rank r on GPU r: the same stack of 4
# GPT blocks (hidden 256, 8 heads, MLP 1024), batch 8 x 64 tokens, SGD with momentum, from the
# same seed's weights; step time and the final weights against each other. NCCL takes no two
# ranks on one GPU, so this needs two.
if ((gpus >= 2)) && grep -q 'paratrain::nccl with' "$out/configure.log"; then
  shape=(--steps "$((quick ? 8 : 30))" --warmup "$((quick ? 3 : 10))" --layers 4 --batch 8 --seq 64 --hidden 256
         --heads 8 --ffn 1024)
  for mode in tp sp; do
    flag=()
    [[ $mode == sp ]] && flag=(--sequence-parallel)
    log=$out/tensor_parallel_$mode
    tests/launch/torchrun_style.sh --timeout 900 2 "$build/benchmarks/bench_tensor_parallel_rendezvous" --device cuda \
      "${shape[@]}" "${flag[@]}" --weights-out "$log.paratrain.weights" >"$log.paratrain.log" 2>&1 || failed=1
    "$python" benchmarks/tensor_parallel_vs_dtensor.py --ranks 2 --device cuda "${shape[@]}" "${flag[@]}" \
      --weights-out "$log.pytorch.weights" >"$log.pytorch.log" 2>&1 || failed=1
    p=$(json "$log.paratrain.log") t=$(json "$log.pytorch.log")
    w=$("$python" benchmarks/compare_weights.py "$log.paratrain.weights" "$log.pytorch.weights" 2>/dev/null || true)
    row "tensor parallel t = 2$([[ $mode == sp ]] && echo " + sequence") ms/step" "$(field "$p" ms_per_step)" \
        "$(field "$t" ms_per_step)" "PyTorch/paratrain $(ratio "$(field "$t" ms_per_step)" "$(field "$p" ms_per_step)") (goal >= 1.0x); weights max rel. diff $(field "$w" max_relative_difference)"
  done
else
  row "tensor parallel vs DTensor, t = 2" "not run" "" "$( ((gpus >= 2)) && echo "no paratrain::nccl" || echo "needs 2 GPUs (NCCL: one rank per GPU)")"
fi


# ---- 5. the table -----------------------------------------------------------------------------
table_and_exit

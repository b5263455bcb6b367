#!/usr/bin/env bash
# Fuzzes paratrain's file readers with libFuzzer for a bounded time, each target in turn:
#   scripts/fuzz.sh [seconds per target (default 120)] [target ...]
# Targets: checkpoint_load (checkpoint::load: index, chunk tables, data) and idx (the
# Fashion-MNIST IDX reader). Starts from the kept inputs in fuzz/corpus/<target>/; inputs
# that add coverage collect in build-fuzz/corpus/<target>/. A crash is written to
# build-fuzz/crashes/<target>/: fix it, then copy the input into fuzz/corpus/<target>/,
# where ctest's fuzz.replay.<target> (built with g++) keeps replaying it.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-120}
shift || true
targets=("$@")
((${#targets[@]})) || targets=(checkpoint_load idx)
scripts/deps.sh
# libFuzzer's runtime (the targets are built with g++: fuzz/coverage.cpp says why).
if ! compgen -G "/usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a" >/dev/null; then
  sudo=; ((EUID == 0)) || sudo=sudo
  $sudo apt-get install -y --no-install-recommends libclang-rt-14-dev
fi
build=build-fuzz
if [[ ! -f $build/build.ninja ]]; then
  cmake -S fuzz -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
fi
cmake --build "$build" -j "$(nproc)" --target "${targets[@]/#/fuzz_}"
for t in "${targets[@]}"; do
  mkdir -p "$build/corpus/$t" "$build/crashes/$t"
  echo "fuzz: $t for $seconds s"
  # ASan's leak check off: LibTorch's registries are never freed (tests/sanitize/lsan.supp).
  ASAN_OPTIONS=detect_leaks=0 "$build/fuzz_$t" -max_total_time="$seconds" -use_value_profile=1 -timeout=10 -rss_limit_mb=4096 \
    -artifact_prefix="$build/crashes/$t/" -print_final_stats=1 "$build/corpus/$t" "fuzz/corpus/$t"
done

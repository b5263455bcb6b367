#!/usr/bin/env bash
# The tests under AddressSanitizer + UndefinedBehaviorSanitizer (issue #10): builds the test
# binary, the planner and schedule tests and the fuzz replays with PARATRAIN_SANITIZE=ON in
# build-sanitize/, then runs what ctest labels `sanitize`: the unit suite's files whose cases
# own memory (tests/CMakeLists.txt, paratrain_memory_tests) on two ranks (under mpirun; every
# case of a one-rank run and the communication paths besides), the planner, the schedules,
# and the kept fuzz inputs.
# Any report fails the run; the only suppressions are tests/sanitize/*.supp's, each justified.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
build=${PARATRAIN_SANITIZE_BUILD_DIR:-build-sanitize}
flags="-O0 -g1"
if ! grep -qxF "CMAKE_CXX_FLAGS:STRING=$flags" "$build/CMakeCache.txt" 2>/dev/null || [[ ! -f "$build/build.ninja" ]]; then
  # -O0 -g1. AddressSanitizer's documentation advises -O1 for the program's speed; here the
  # sanitized suite runs as fast at -O0 (its ctest 118 s, 110 s at -O1) and compiles in half
  # the time (sharded_test.cpp: 57 CPU-s, 108 at -O1), and no optimisation removes an access
  # before it is checked. -g1: line tables, what a report's file:line needs, without full
  # debug information.
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE= -DCMAKE_CXX_FLAGS="$flags" -DPARATRAIN_SANITIZE=ON \
    -DPARATRAIN_BUILD_EXAMPLES=OFF -DPARATRAIN_BUILD_BENCHMARKS=OFF -DPARATRAIN_BUILD_TOOLS=OFF \
    -DPARATRAIN_WITH_NCCL=OFF -DPARATRAIN_WITH_GLOO=OFF >/dev/null
fi
cmake --build "$build" -j "$(nproc)" --target paratrain_tests plan_test schedule_test \
  fuzz_replay_checkpoint_load fuzz_replay_idx
supp=$PWD/tests/sanitize
# Leak checking (Note [Leak check before MPI_Finalize], tests/main.cpp): the MPI suite checks
# before MPI_Finalize, where Open MPI's state is still reachable, with ASan's fast unwinder
# (the default; full DWARF unwinding at every allocation made the two-rank run 3.6x slower:
# 163 s against 45 s). Every library stays loaded (keep_loaded.c: dlclose does nothing), so
# each frame of a report names its module, which is what tests/sanitize/lsan.supp matches.
keep=$(realpath "$build")/keep_loaded.so
cc -shared -fPIC -O2 -o "$keep" "$supp/keep_loaded.c"
export LD_PRELOAD="$keep${LD_PRELOAD:+:$LD_PRELOAD}"
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:detect_stack_use_after_return=0:verify_asan_link_order=0:${ASAN_OPTIONS:-}"
export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0:${LSAN_OPTIONS:-}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:suppressions=$supp/ubsan.supp:${UBSAN_OPTIONS:-}"
cd "$build"
ctest --output-on-failure --no-tests=error -j "$(nproc)" -L sanitize "$@"

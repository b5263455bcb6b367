# Sourced by the benchmark drivers (the *_vs_torch.sh scripts and those of one benchmark binary): running a side on a quiet machine, and saying what
# machine it was. Needs $tmp (a scratch directory) and $python (the peer's interpreter).

# require_built BUILD_DIR TARGET...: stops, naming the build command, unless each example is built.
require_built() {
  local build=$1 target
  shift
  for target in "$@"; do
    if [[ ! -x $build/examples/$target ]]; then
      echo "$build/examples/$target is missing; build it: cmake --build $build --target $target" >&2
      exit 1
    fi
  done
}

# benchmark_setup TARGET: what a driver of one benchmark binary starts with: $bench, TARGET
# in $build/benchmarks (stops, naming the build command, unless it is built), one intra-op
# thread per rank, and a scratch $tmp removed on exit.
benchmark_setup() {
  bench=$build/benchmarks/$1
  [[ -x $bench ]] || { echo "$bench is missing; build it: cmake --build $build --target $1" >&2; exit 1; }
  export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
}

# same_environment "$0" ARGS...: both sides' settings (one thread per rank; glibc's
# allocator as paratrain sets it, Note [Allocator], stated for PyTorch too), and in
# $command the driver's command line with what in the environment changes the numbers.
same_environment() {
  export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
  export MALLOC_MMAP_THRESHOLD_=67108864 MALLOC_TRIM_THRESHOLD_=2147483647
  command="$({ env | grep -E '^(GLIBC_TUNABLES|MALLOC_[A-Z_]+|OMPI_MCA_[A-Za-z0-9_]+)=' || true; } | sort | tr '\n' ' ')$*"
  echo "Command: $command" >&2
}

busy_ticks() {  # CPU time spent by everything on the machine, in clock ticks
  local _ user nice system idle iowait irq softirq steal
  read -r _ user nice system idle iowait irq softirq steal _ </proc/stat
  echo $((user + nice + system + irq + softirq + steal))
}

wait_quiet() {  # until the machine is under 10% busy over 2 s, for at most 120 s
  local start=$SECONDS b
  while ((SECONDS - start < 120)); do
    b=$(busy_ticks)
    sleep 2
    (( ($(busy_ticks) - b) * 100 / $(getconf CLK_TCK) / 2 < 10 )) && return 0
  done
  echo "  (the machine stayed busy; measuring anyway)" >&2
}

# run_clean COMMAND...: runs it (its output shown on stderr), appends its last JSON line,
# with the share of a core that other processes took meanwhile, to $tmp/results; repeats
# it if that share was over 10%, up to ${RUN_CLEAN_TRIES:-5} tries (the last one is kept).
run_clean() {
  local attempt tries=${RUN_CLEAN_TRIES:-5} before after wall user sys others
  echo "\$ $*" >&2
  for ((attempt = 1; attempt <= tries; ++attempt)); do
    wait_quiet
    before=$(busy_ticks)
    /usr/bin/time -f '%e %U %S' -o "$tmp/time" "$@" | tee "$tmp/out" >&2
    after=$(busy_ticks)
    read -r wall user sys <"$tmp/time"  # the launcher's children: every rank
    others=$(awk -v t=$((after - before)) -v hz="$(getconf CLK_TCK)" -v w="$wall" -v u="$user" -v s="$sys" \
      'BEGIN { o = (t / hz - u - s) / w; printf "%.3f", o < 0 ? 0 : o }')
    if awk -v o="$others" 'BEGIN { exit !(o <= 0.10) }' || ((attempt == tries)); then
      ((attempt == tries && tries > 1)) && echo "  (others took ${others} of a core during the last try; kept anyway)" >&2
      grep -E '^\{' "$tmp/out" | tail -n 1 | jq -c --argjson others "$others" '. + {others_cpu: $others}' \
        >>"$tmp/results"
      return 0
    fi
    echo "  (others took ${others} of a core during this run: repeating it)" >&2
  done
}

machine_line() {
  echo "Machine: $(env -u OMP_NUM_THREADS nproc) cores ($(lscpu | sed -n 's/^Model name: *//p')), $(. /etc/os-release && echo "$PRETTY_NAME"),\
 LibTorch $(dpkg-query -W -f '${Version}' libtorch-dev 2>/dev/null || echo '?'),\
 PyTorch $("$python" -c 'import torch; print(torch.__version__)'), $(mpirun --version | head -1)"
}

#!/usr/bin/env bash
# The suite against LibTorch 2.6 as GPU users link it: Debian 13's CUDA build
# (libtorch-cuda-dev, contrib) with the CUDA toolkit 12.4 and NCCL 2.22 it depends on
# (non-free), beside this machine's own LibTorch 1.13 and without touching it (Note
# [LibTorch versions]):
#  1. makes, once, a Debian 13 root with that LibTorch and the project's other dependencies
#     (mmdebstrap: ~4 GB to download, 2-6 minutes, ~5 GB on disk; kept in PARATRAIN_COMPAT_ROOT
#     and reused while the package list below is unchanged);
#  2. copies this working tree in (what git tracks or would track: a clone's files and the
#     change at hand), only the files whose content changed, so that a rerun, or a fresh
#     clone's run, rebuilds what changed;
#  3. builds there with paratrain::nccl and ::gloo, so that every CUDA code path is compiled
#     and linked against the CUDA LibTorch (every strategy over comm::Nccl:
#     tests/unit/nccl_test.cpp; the GPU suite: tests/gpu/; the examples' CUDA builds; the GPU
#     benchmark gpu-check.sh runs, with CUDA's allocator statistics: bench_zero_rendezvous), and runs
#     what runs without a GPU: the unit suite at 1 and 2 ranks, the NCCL bootstrap tests, the
#     Gloo suite at 1 and 2 ranks with the GPU suite's checks on the CPU, the compile-fail tests
#     and the smoke runs of one example build per kind of program (below).
#
# cuDNN: Debian's nvidia-cudnn package downloads cuDNN from NVIDIA when it is installed, which
# a machine without that access cannot do, and libtorch-cuda-2.6 depends on it. The root holds
# a stand-in package of that name, and, made from the symbols libtorch_cuda.so asks of it, a
# stand-in libcudnn.so.9 whose every function traps: LibTorch's libraries load (they bind every
# symbol at load), and paratrain calls no cuDNN. No GPU code runs here: there is no GPU.
#
# Needs root or sudo (mmdebstrap, chroot, mounts in a private namespace that ends with it).
# Usage: scripts/compat.sh [ctest arguments]
#        scripts/compat.sh --prepare: step 1 only (scripts/test.sh runs it during the main
#        build: it waits on the network, the build on the cores)
#        scripts/compat.sh --headers: step 3 compiles every public header alone as well (the
#        1.13 build's check, against the CUDA LibTorch; ~4 more minutes, not in CI)
set -euo pipefail
cd "$(dirname "$0")/.."

# Step 3, inside the root (scripts/compat.sh --inside, run by step 2 below).
if [[ ${1:-} == --inside ]]; then
  shift
  headers=0
  [[ ${1:-} == --headers ]] && { headers=1; shift; }
  build=/build/paratrain
  mkdir -p /build
  echo "paratrain: $(dpkg-query -W -f '${Package} ${Version}' libtorch-cuda-dev), CUDA" \
       "$(dpkg-query -W -f '${Version}' nvidia-cuda-toolkit), NCCL $(dpkg-query -W -f '${Version}' libnccl-dev)," \
       "g++ $(g++ -dumpversion), Open MPI $(dpkg-query -W -f '${Version}' openmpi-bin)"
  # At -O0, as the 1.13 build (scripts/build.sh says why). Configured each time, so that a
  # root kept from before takes the flags (a build made with others is rebuilt).
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE="-O0 -DNDEBUG" \
    -DPARATRAIN_WITH_NCCL=ON -DPARATRAIN_WITH_GLOO=ON -DCUDAToolkit_ROOT=/usr >"$build.configure.log" 2>&1 ||
    { tail -40 "$build.configure.log"; exit 1; }
  grep -E '^-- paratrain:' "$build.configure.log"
  grep -q 'paratrain::nccl with' "$build.configure.log" ||
    { echo "paratrain: the CUDA LibTorch's root configured without paratrain::nccl" >&2; exit 1; }
  # What the runs below need (the headers-alone checks are the 1.13 build's, unless asked).
  # Of the examples, one build per kind of program and path: DDP over MPI (the Fashion-MNIST
  # program), the README's program over NCCL (`comm::Nccl` made from the launcher's variables,
  # its CUDA path: the quickstart alias compiled against the CUDA LibTorch) and a pipeline (the
  # Transformer program); the other builds differ only in the strategy alias, whose every
  # strategy the unit suite trains here against the reference (ZeRO 1-3, DP, Gloo, pipelines
  # with ZeRO-3); the 1.13 build runs all of them.
  examples=(fashion_mnist_ddp quickstart_ddp_nccl transformer_pipeline)
  # The example tests of those builds: their runs, the refusals, the time limit.
  example_tests='^(example\.(fashion_mnist_ddp\.np2|transformer_pipeline\.np2|missing_data\.np2|launch_conflict\.np2|cuda_over_mpi_refused\.np2|time_limit_resumes\.np2)|quickstart\.ddp_nccl\.np2)$'
  # Not mapfile < <(...): the root has no /dev/fd.
  alone=()
  if ((headers)); then
    read -r -d '' -a alone <<<"$(ninja -C "$build" -t targets all |
      grep -oE '^paratrain_[a-z0-9_]*headers_alone[a-z_]*:' | tr -d : | sort -u)" || true
  fi
  cmake --build "$build" -j "$(nproc)" --target paratrain_tests paratrain_gloo_tests paratrain_nccl_tests \
    "${examples[@]}" bench_zero_rendezvous "${alone[@]}"
  cd "$build"
  # The compile-time refusals whose concepts read LibTorch's own types (modules, optimizers,
  # Cloneable): the others check paratrain's communicator, sampler, dataset, stage and hook
  # concepts against paratrain's and the tests' own types, the same under either LibTorch,
  # and the 1.13 build runs them. (ctest adds the test that compiles every case, which they
  # need: Note [Compile-fail cases in one translation unit].)
  torch_refusals='compile_fail\.(checkpoint_with_unknown_optimizer|data_parallel_with_non_tensor_forward|data_parallel_with_optimizer_instance_type|local_data_parallel_not_cloneable|pipeline_stage_mismatch|recompute_of_unit)'
  # Two runs, each packed by ctest -j: the unit suites at 1 and 2 ranks, the refusals and the
  # example runs; then the Gloo-labelled tests at 1 and 2 ranks (the 1.13 build runs 4).
  ctest --output-on-failure --no-tests=error -j "$(nproc)" \
    -R "^(paratrain_(tests|nccl_tests)\.np[12]|$torch_refusals)\$|${example_tests}" "$@"
  ctest --output-on-failure --no-tests=error -j "$(nproc)" -L '^gloo$' -E '\.np[3-9]$' "$@"
  exit 0
fi
root=${PARATRAIN_COMPAT_ROOT:-/var/cache/paratrain/trixie-cuda}
# mmdebstrap's default mirror unless PARATRAIN_COMPAT_MIRROR names one (a local mirror, a proxy).
mirrors=()
[[ -n ${PARATRAIN_COMPAT_MIRROR:-} ]] && mirrors=("$PARATRAIN_COMPAT_MIRROR")
packages=(
  libtorch-cuda-dev nvidia-cuda-toolkit libnccl-dev libgloo-cuda-dev libopenblas0-openmp g++ cmake ninja-build
  libopenmpi-dev openmpi-bin libboost-mpi-dev librange-v3-dev doctest-dev nlohmann-json3-dev
  libcli11-dev zlib1g-dev libhdf5-dev python3 dataset-fashion-mnist
)

sudo=()
if ((EUID != 0)); then
  command -v sudo >/dev/null || { echo "paratrain: compat.sh needs root or sudo (mmdebstrap, chroot)" >&2; exit 1; }
  sudo=(sudo)
fi

if [[ "$("${sudo[@]}" cat "$root/.paratrain-packages" 2>/dev/null)" != "${packages[*]}" ]]; then
  if ! command -v mmdebstrap >/dev/null; then
    echo "paratrain: installing mmdebstrap"
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap >/dev/null ||
      { "${sudo[@]}" apt-get update -qq && "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
          apt-get install -y -qq --no-install-recommends mmdebstrap >/dev/null; }
  fi
  # The stand-in for nvidia-cudnn (see above): an empty package of its name and version.
  stand_in=$(mktemp -d)
  trap 'rm -rf "$stand_in"' EXIT
  mkdir -p "$stand_in/pkg/DEBIAN"
  cat >"$stand_in/pkg/DEBIAN/control" <<'EOF'
Package: nvidia-cudnn
Version: 9.0.0.312~cuda12-0paratrain1
Architecture: amd64
Maintainer: paratrain <paratrain@localhost>
Description: stand-in for nvidia-cudnn, whose installer downloads cuDNN from NVIDIA
 Lets libtorch-cuda-dev install; its libcudnn.so.9 is made after, from LibTorch's symbols.
EOF
  dpkg-deb --build --root-owner-group "$stand_in/pkg" "$stand_in/nvidia-cudnn.deb" >/dev/null
  # The stand-in library: one trapping function per cuDNN symbol libtorch_cuda.so binds, under
  # cuDNN's version node, built by the root's own compiler.
  cat >"$stand_in/cudnn-stand-in.sh" <<'EOF'
set -eu
lib=/usr/lib/x86_64-linux-gnu
cd "$(mktemp -d)"
syms=$(nm -D --undefined-only "$lib/libtorch_cuda.so" | awk '{print $2}' | sed -n 's/@libcudnn\.so\.9$//p')
[ -n "$syms" ] || { echo "paratrain: libtorch_cuda.so asks libcudnn.so.9 for nothing?" >&2; exit 1; }
for s in $syms; do echo "void $s(void) { __builtin_trap(); }"; done >stand_in.c
{ echo "libcudnn.so.9 { global:"; for s in $syms; do echo "  $s;"; done; echo "local: *; };"; } >stand_in.map
gcc -shared -fPIC -O1 -Wl,-soname,libcudnn.so.9 -Wl,--version-script=stand_in.map stand_in.c -o "$lib/libcudnn.so.9"
echo "paratrain: a stand-in libcudnn.so.9 with $(echo "$syms" | wc -w) trapping functions"
EOF
  chmod -R a+rX "$stand_in"
  echo "paratrain: making a Debian 13 root with the CUDA LibTorch 2.6 in $root (~4 GB to download)"
  start=$(date +%s)
  "${sudo[@]}" rm -rf "$root.new"
  "${sudo[@]}" mkdir -p "$(dirname "$root")"
  # The stand-in is copied to the same path inside the root (apt names it to dpkg there), not
  # bind-mounted: a mount would outlive a failed run and block the next one's clean-up.
  # Less written beside the build that scripts/test.sh runs meanwhile: the CUDA libraries'
  # static archives (3 GB: all but cudart's, which CMake's check of nvcc links, LibTorch's
  # config enabling the CUDA language) and the docs are left out as dpkg unpacks, and dpkg does
  # not fsync each file (a root cut off half-made is made again: its package list is written
  # last). Measured, the main build took 582 s alone, 662 s beside the root as packaged and
  # fsync'd, 610 s beside it so.
  "${sudo[@]}" mmdebstrap --quiet --variant=apt --components="main contrib non-free" --dpkgopt=force-unsafe-io \
    --dpkgopt='path-exclude=/usr/lib/x86_64-linux-gnu/lib*_static*.a' \
    --dpkgopt='path-include=/usr/lib/x86_64-linux-gnu/libcudart_static.a' --dpkgopt='path-exclude=/usr/share/doc/*' \
    --setup-hook="mkdir -p \"\$1$stand_in\" && cp $stand_in/nvidia-cudnn.deb $stand_in/cudnn-stand-in.sh \"\$1$stand_in/\"" \
    --customize-hook="chroot \"\$1\" sh $stand_in/cudnn-stand-in.sh" \
    --customize-hook="rm -rf \"\$1$stand_in\" \"\$1\"/var/cache/apt/archives/*.deb" \
    --include="$stand_in/nvidia-cudnn.deb" --include="$(IFS=,; echo "${packages[*]}")" \
    trixie "$root.new" "${mirrors[@]}" </dev/null
  echo "${packages[*]}" | "${sudo[@]}" tee "$root.new/.paratrain-packages" >/dev/null
  "${sudo[@]}" rm -rf "$root"
  "${sudo[@]}" mv "$root.new" "$root"
  echo "paratrain: root made in $(($(date +%s) - start)) s ($("${sudo[@]}" du -sh "$root" | cut -f1))"
fi
[[ ${1:-} == --prepare ]] && exit 0

# The sources, copied in so that the root's build (kept in /build/paratrain) recompiles only
# what changed.
scripts/sync-into-root.sh "$root/src/paratrain"

# In a mount namespace of its own: the root's /proc, /dev and /sys vanish with it.
"${sudo[@]}" unshare --mount --fork bash -euo pipefail -c '
  root=$1
  shift
  mount -t proc proc "$root/proc"
  mount --rbind /dev "$root/dev"
  mount --rbind /sys "$root/sys"
  exec chroot "$root" /usr/bin/env -i HOME=/root PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 \
    /src/paratrain/scripts/compat.sh --inside "$@"' compat "$root" "$@"

#!/usr/bin/env bash
# Compiles and links every CUDA code path of paratrain against a CUDA build of LibTorch:
# Debian 13's libtorch-cuda-dev 2.6 (contrib) with the CUDA toolkit 12.4 and NCCL 2.22 it
# depends on (non-free), in a Debian 13 root of its own, without touching this machine.
#  1. makes, once, the root (mmdebstrap; ~4 GB to download, ~10 GB on disk; kept in
#     PARATRAIN_CUDA_ROOT and reused while the package list below is unchanged);
#  2. copies this working tree in (what git tracks or would track);
#  3. configures with paratrain::mpi, ::nccl and ::gloo and builds: every header alone per
#     component, the GPU suite (tests/gpu/), the NCCL suite with every strategy instantiated
#     over comm::Nccl (tests/unit/nccl_test.cpp), the test suite, and the examples' CUDA
#     builds (fashion_mnist_ddp_nccl, fashion_mnist_ddp_gloo, transformer_single).
# Nothing runs there: there is no GPU. It is not part of scripts/test.sh (CI): the download
# and the build do not fit CI's 30 minutes beside the rest (docs/testing.md gives the
# costs); CI compiles the same CUDA paths against the host's CUDA 13 and NCCL 2.28 with
# Debian 12's LibTorch, whose headers have no CUDA (Note [NCCL without CUDA-enabled LibTorch]).
#
# cuDNN: Debian's nvidia-cudnn package downloads cuDNN from NVIDIA when it is installed,
# which a machine without that access cannot do; libtorch-cuda-2.6 depends on it. The root
# holds a stand-in package of that name instead, so cuDNN's library is absent, and the links
# here accept symbols that only LibTorch's own libraries lack (-Wl,--allow-shlib-undefined):
# paratrain calls no cuDNN.
#
# Needs root or sudo (mmdebstrap, chroot). Usage: scripts/cuda-compile.sh [--prepare]
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ ${1:-} == --inside ]]; then
  build=/build/paratrain-cuda
  mkdir -p /build
  echo "paratrain: $(dpkg-query -W -f '${Package} ${Version}' libtorch-cuda-dev), CUDA $(dpkg-query -W -f '${Version}' nvidia-cuda-toolkit), NCCL $(dpkg-query -W -f '${Version}' libnccl-dev), g++ $(g++ -dumpversion)"
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE="-O0 -DNDEBUG" \
    -DCMAKE_EXE_LINKER_FLAGS=-Wl,--allow-shlib-undefined -DPARATRAIN_WITH_NCCL=ON -DPARATRAIN_WITH_GLOO=ON \
    -DPARATRAIN_WITH_HDF5=OFF -DCUDAToolkit_ROOT=/usr >"$build.configure.log" 2>&1 ||
    { tail -40 "$build.configure.log"; exit 1; }
  grep -E '^-- paratrain:' "$build.configure.log"
  # Not mapfile < <(...): the root has no /dev/fd.
  alone=$(ninja -C "$build" -t targets all | grep -oE '^paratrain_[a-z0-9_]*headers_alone[a-z_]*:' | tr -d : | sort -u)
  read -r -d '' -a alone <<<"$alone" || true
  start=$(date +%s)
  cmake --build "$build" -j "$(nproc)" --target "${alone[@]}" paratrain_gloo_tests paratrain_nccl_tests \
    paratrain_tests fashion_mnist_ddp_nccl fashion_mnist_ddp_gloo transformer_single -- -k 0  # every error, not the first
  echo "paratrain: compiled and linked against the CUDA LibTorch in $(($(date +%s) - start)) s"
  exit 0
fi

root=${PARATRAIN_CUDA_ROOT:-/var/cache/paratrain/trixie-cuda}
mirror=${PARATRAIN_COMPAT_MIRROR:-http://deb.debian.org/debian}
packages=(
  libtorch-cuda-dev nvidia-cuda-toolkit libnccl-dev libgloo-cuda-dev g++ cmake ninja-build
  libopenmpi-dev openmpi-bin libboost-mpi-dev librange-v3-dev doctest-dev nlohmann-json3-dev
  libcli11-dev zlib1g-dev python3
)
sudo=()
if ((EUID != 0)); then
  command -v sudo >/dev/null || { echo "paratrain: cuda-compile.sh needs root or sudo (mmdebstrap, chroot)" >&2; exit 1; }
  sudo=(sudo)
fi

if [[ "$("${sudo[@]}" cat "$root/.paratrain-packages" 2>/dev/null)" != "${packages[*]}" ]]; then
  command -v mmdebstrap >/dev/null ||
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap >/dev/null
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
 Lets libtorch-cuda-dev install for compiling; provides no cuDNN.
EOF
  dpkg-deb --build --root-owner-group "$stand_in/pkg" "$stand_in/nvidia-cudnn.deb" >/dev/null
  chmod -R a+rX "$stand_in"
  echo "paratrain: making a Debian 13 root with the CUDA LibTorch 2.6 in $root (~4 GB to download)"
  start=$(date +%s)
  "${sudo[@]}" rm -rf "$root.new"
  "${sudo[@]}" mkdir -p "$(dirname "$root")"
  # The stand-in is copied to the same path inside the root (apt names it to dpkg there), not
  # bind-mounted: a mount would outlive a failed run and block the next one's clean-up.
  "${sudo[@]}" mmdebstrap --quiet --variant=apt --components="main contrib non-free" \
    --setup-hook="mkdir -p \"\$1$stand_in\" && cp $stand_in/nvidia-cudnn.deb \"\$1$stand_in/\"" \
    --customize-hook="rm -rf \"\$1$stand_in\"" \
    --include="$stand_in/nvidia-cudnn.deb" --include="$(IFS=,; echo "${packages[*]}")" \
    trixie "$root.new" "$mirror"
  "${sudo[@]}" rm -rf "$root.new/var/cache/apt/archives"/*.deb  # 4 GB of packages, installed already
  echo "${packages[*]}" | "${sudo[@]}" tee "$root.new/.paratrain-packages" >/dev/null
  "${sudo[@]}" rm -rf "$root"
  "${sudo[@]}" mv "$root.new" "$root"
  echo "paratrain: root made in $(($(date +%s) - start)) s ($("${sudo[@]}" du -sh --exclude=proc "$root" | cut -f1))"
fi
[[ ${1:-} == --prepare ]] && exit 0

scripts/sync-into-root.sh "$root/src/paratrain"
"${sudo[@]}" chroot "$root" bash -c "cd /src/paratrain && scripts/cuda-compile.sh --inside"

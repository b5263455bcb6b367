#!/usr/bin/env bash
# A Debian 13 root with PyTorch 2.6 (python3-torch, CPU) and LibTorch 2.6 (libtorch-dev, CPU)
# beside this machine's own PyTorch/LibTorch 1.13, for the benchmarks whose PyTorch side needs
# what 1.13 lacks (benchmarks/tensor_parallel_vs_dtensor.py: DTensor tensor parallelism), and
# the project's build dependencies, so that paratrain's side can be built against the same
# LibTorch there. The shape of scripts/compat.sh's root (the CUDA one, for CI):
#  1. makes, once, the root (mmdebstrap; kept in PARATRAIN_PEER_ROOT and reused while the
#     package list below is unchanged; made in ROOT.new and moved into place when whole);
#  2. copies this working tree into ROOT/src/paratrain (scripts/sync-into-root.sh);
#  3. runs COMMAND there, in /src/paratrain, with a clean environment (OMPI_ALLOW_RUN_AS_ROOT
#     set: mpirun runs as root inside).
#
# Needs root or sudo (mmdebstrap, chroot, mounts in a private namespace that ends with it).
# Usage: scripts/peer-root.sh --prepare: step 1 only
#        scripts/peer-root.sh COMMAND...: steps 1-3, e.g.
#          scripts/peer-root.sh env OMP_NUM_THREADS=1 python3 benchmarks/tensor_parallel_vs_dtensor.py --ranks 2
# /tmp inside is the root's own /tmp (ROOT/tmp here).
set -euo pipefail
cd "$(dirname "$0")/.."

root=${PARATRAIN_PEER_ROOT:-/var/cache/paratrain/trixie-peer}
# mmdebstrap's default mirror unless PARATRAIN_COMPAT_MIRROR names one (a local mirror, a proxy).
mirrors=()
[[ -n ${PARATRAIN_COMPAT_MIRROR:-} ]] && mirrors=("$PARATRAIN_COMPAT_MIRROR")
# libopenblas0-openmp as scripts/deps.sh installs it: without it the root's BLAS is the
# reference libblas3, and PyTorch's (and LibTorch's) CPU matrix products run ~3x slower.
# libgloo-dev: paratrain::gloo, the transport PyTorch's side runs over.
packages=(
  python3-torch libtorch-dev libopenblas0-openmp libgloo-dev g++ cmake ninja-build libopenmpi-dev openmpi-bin
  libboost-mpi-dev librange-v3-dev doctest-dev nlohmann-json3-dev libcli11-dev zlib1g-dev libhdf5-dev jq python3-numpy
)

sudo=()
if ((EUID != 0)); then
  command -v sudo >/dev/null || { echo "paratrain: peer-root.sh needs root or sudo (mmdebstrap, chroot)" >&2; exit 1; }
  sudo=(sudo)
fi

if [[ "$("${sudo[@]}" cat "$root/.paratrain-packages" 2>/dev/null)" != "${packages[*]}" ]]; then
  if ! command -v mmdebstrap >/dev/null; then
    echo "paratrain: installing mmdebstrap"
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap >/dev/null ||
      { "${sudo[@]}" apt-get update -qq && "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
          apt-get install -y -qq --no-install-recommends mmdebstrap >/dev/null; }
  fi
  echo "paratrain: making a Debian 13 root with PyTorch/LibTorch 2.6 (CPU) in $root"
  start=$(date +%s)
  "${sudo[@]}" rm -rf "$root.new"
  "${sudo[@]}" mkdir -p "$(dirname "$root")"
  # dpkg does not fsync each file (a root cut off half-made is made again: its package list
  # is written last), and the docs are left out, as in scripts/compat.sh.
  "${sudo[@]}" mmdebstrap --quiet --variant=apt --dpkgopt=force-unsafe-io --dpkgopt='path-exclude=/usr/share/doc/*' \
    --customize-hook="rm -rf \"\$1\"/var/cache/apt/archives/*.deb" \
    --include="$(IFS=,; echo "${packages[*]}")" \
    trixie "$root.new" "${mirrors[@]}" </dev/null
  echo "${packages[*]}" | "${sudo[@]}" tee "$root.new/.paratrain-packages" >/dev/null
  "${sudo[@]}" rm -rf "$root"
  "${sudo[@]}" mv "$root.new" "$root"
  echo "paratrain: root made in $(($(date +%s) - start)) s ($("${sudo[@]}" du -sh "$root" | cut -f1))"
fi
[[ ${1:-} == --prepare ]] && exit 0
(($#)) || { echo "usage: scripts/peer-root.sh --prepare | COMMAND..." >&2; exit 2; }

scripts/sync-into-root.sh "$root/src/paratrain"

# In a mount namespace of its own: the root's /proc, /dev and /sys vanish with it.
"${sudo[@]}" unshare --mount --fork bash -euo pipefail -c '
  root=$1
  shift
  mount -t proc proc "$root/proc"
  mount --rbind /dev "$root/dev"
  mount --rbind /sys "$root/sys"
  exec chroot "$root" /usr/bin/env -i HOME=/root PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 \
    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
    /bin/bash -c "cd /src/paratrain && exec \"\$@\"" peer "$@"' peer "$root" "$@"

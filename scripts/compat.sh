#!/usr/bin/env bash
# The suite against LibTorch 2.6 (Debian 13's libtorch-dev), beside this machine's own
# LibTorch 1.13 and without touching it (Note [LibTorch versions]):
#  1. makes, once, a Debian 13 root with LibTorch 2.6 and the project's other dependencies
#     (mmdebstrap, ~1.5 min; kept in PARATRAIN_COMPAT_ROOT and reused while the package
#     list below is unchanged);
#  2. copies this working tree in (what git tracks or would track: a clone's files and the
#     change at hand), only the files whose content changed, so that a rerun, or a fresh
#     clone's run, rebuilds what changed;
#  3. builds there and runs the unit suite at 1 and 2 ranks, the Gloo suite, the
#     compile-fail tests and the examples' smoke runs.
# Needs root or sudo (mmdebstrap, chroot, mounts in a private namespace that ends with it).
# Usage: scripts/compat.sh [ctest arguments]
#        scripts/compat.sh --prepare: step 1 only (scripts/test.sh runs it during the main
#        build: it waits on the network, the build on the cores)
set -euo pipefail
cd "$(dirname "$0")/.."

# Step 3, inside the root (scripts/compat.sh --inside, run by step 2 below).
if [[ ${1:-} == --inside ]]; then
  shift
  build=/build/paratrain
  echo "paratrain: LibTorch $(dpkg-query -W -f '${Version}' libtorch-dev), g++ $(g++ -dumpversion)," \
       "Open MPI $(dpkg-query -W -f '${Version}' openmpi-bin)"
  # At -O0, as the 1.13 build (scripts/build.sh says why). Configured each time, so that a
  # root kept from before takes the flags (a build made with others is rebuilt).
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE="-O0 -DNDEBUG" >/dev/null
  # What the runs below need: not the headers-alone checks (the 1.13 build has them).
  mapfile -t examples < <(ninja -C "$build" -t targets all | grep -oE '^(fashion_mnist|transformer)_[a-z0-9_]+:' | tr -d : | sort -u)
  cmake --build "$build" -j "$(nproc)" --target paratrain_tests paratrain_gloo_tests "${examples[@]}"
  cd "$build"
  ctest --output-on-failure -j "$(nproc)" -R '^paratrain_tests\.np[12]$' "$@"
  ctest --output-on-failure -j "$(nproc)" -L '^(compile_fail|example|gloo)$' "$@"
  exit 0
fi
root=${PARATRAIN_COMPAT_ROOT:-/var/cache/paratrain/trixie}
mirror=${PARATRAIN_COMPAT_MIRROR:-http://deb.debian.org/debian}
packages=(
  libtorch-dev libopenblas0-openmp libgloo-dev g++ cmake ninja-build
  libopenmpi-dev openmpi-bin libboost-mpi-dev librange-v3-dev doctest-dev nlohmann-json3-dev
  libcli11-dev zlib1g-dev libhdf5-dev python3 dataset-fashion-mnist
)

sudo=()
if ((EUID != 0)); then
  command -v sudo >/dev/null || { echo "paratrain: compat.sh needs root or sudo (mmdebstrap, chroot)" >&2; exit 1; }
  sudo=(sudo)
fi

if [[ "$(cat "$root/.paratrain-packages" 2>/dev/null)" != "${packages[*]}" ]]; then
  if ! command -v mmdebstrap >/dev/null; then
    echo "paratrain: installing mmdebstrap"
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap >/dev/null ||
      { "${sudo[@]}" apt-get update -qq && "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
          apt-get install -y -qq --no-install-recommends mmdebstrap >/dev/null; }
  fi
  echo "paratrain: making a Debian 13 root with LibTorch 2.6 in $root"
  "${sudo[@]}" rm -rf "$root.new"
  "${sudo[@]}" mkdir -p "$(dirname "$root")"
  "${sudo[@]}" mmdebstrap --quiet --variant=apt --include="$(IFS=,; echo "${packages[*]}")" trixie "$root.new" "$mirror"
  echo "${packages[*]}" | "${sudo[@]}" tee "$root.new/.paratrain-packages" >/dev/null
  "${sudo[@]}" rm -rf "$root"
  "${sudo[@]}" mv "$root.new" "$root"
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

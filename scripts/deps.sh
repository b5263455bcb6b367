#!/usr/bin/env bash
# Installs what paratrain needs from Debian 12 when it is missing; quiet when all is present.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config
  libtorch-dev libopenblas0-openmp libgloo-dev
  libopenmpi-dev openmpi-bin libboost-mpi-dev
  librange-v3-dev doctest-dev nlohmann-json3-dev libcli11-dev zlib1g-dev protobuf-compiler python3
  libhdf5-dev
  dataset-fashion-mnist
  python3-torch  # checkpoint.python_load: Python's torch.load reads the model file
)
# The rest of the PyTorch peer: the side-by-side benchmarks and regenerating reference data.
[[ "${PARATRAIN_WITH_PEER:-0}" == 1 ]] && packages+=(jq time)  # jq, time: benchmarks/ddp_vs_torch.sh
# h5py writes the HDF5 test files (tests/data/make_hdf5.py); they are committed.
[[ "${PARATRAIN_WITH_PEER:-0}" == 1 ]] && packages+=(python3-h5py)
# jemalloc: the allocator benchmarks/memory_breakdown.sh measures beside glibc.
[[ "${PARATRAIN_WITH_PEER:-0}" == 1 ]] && packages+=(libjemalloc2)
# matplotlib and doxygen only for docs: scripts/plot.py, scripts/docs.sh.
[[ "${PARATRAIN_WITH_DOCS:-0}" == 1 ]] && packages+=(python3-matplotlib doxygen)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
((${#missing[@]} == 0)) && exit 0

sudo=()
if ((EUID != 0)); then
  command -v sudo >/dev/null || { echo "paratrain: need root or sudo to install: ${missing[*]}" >&2; exit 1; }
  sudo=(sudo)
fi
echo "paratrain: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null

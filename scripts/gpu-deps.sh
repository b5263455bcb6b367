#!/usr/bin/env bash
# Prepares, on a Debian machine with apt, what scripts/gpu-check.sh needs on a GPU machine that
# may have no package manager: the header-only dependencies (range-v3, doctest, nlohmann-json,
# CLI11), zlib, Gloo's headers (in case the LibTorch there ships none) and the Fashion-MNIST data,
# unpacked from Debian's packages into one folder (default .gpu-deps/, which git ignores).
# Copy the working tree with that folder to the GPU machine (the device tool: carry
# .gpu-deps), then run scripts/gpu-check.sh there.
#
# Usage: scripts/gpu-deps.sh [FOLDER]
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-.gpu-deps}")
packages=(librange-v3-dev doctest-dev nlohmann-json3-dev libcli11-dev libgloo-dev zlib1g-dev zlib1g dataset-fashion-mnist)

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
download() { (cd "$work" && apt-get download "${packages[@]}" >/dev/null 2>&1); }
if ! download; then
  # A machine whose package lists are empty (a fresh container): read them once.
  sudo=()
  ((EUID == 0)) || sudo=(sudo)
  "${sudo[@]}" apt-get update -qq
  download || { echo "gpu-deps.sh: apt-get download ${packages[*]} failed" >&2; exit 1; }
fi
rm -rf "$out.new"
mkdir -p "$out.new"
for deb in "$work"/*.deb; do dpkg-deb -x "$deb" "$out.new"; done
# What each package was, for the check's report.
for deb in "$work"/*.deb; do dpkg-deb -f "$deb" Package Version | paste -sd' '; done >"$out.new/PACKAGES"
rm -rf "$out"
mv "$out.new" "$out"
echo "gpu-deps.sh: $(wc -l <"$out/PACKAGES") packages in $out ($(du -sh "$out" | cut -f1)):"
sed 's/^/  /' "$out/PACKAGES"

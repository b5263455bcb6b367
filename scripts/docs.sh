#!/usr/bin/env bash
# Generates the API reference from the headers' comments into build/docs/api/html (the
# plots of docs/plots are scripts/plot.py's; the pictures of docs/pictures, from the data in
# docs/pictures/data, are redrawn by scripts/pictures.sh, which --record re-measures).
set -euo pipefail
cd "$(dirname "$0")/.."
PARATRAIN_WITH_DOCS=1 scripts/deps.sh
out=${PARATRAIN_BUILD_DIR:-build}/docs/api
mkdir -p "$out"
(cat docs/Doxyfile; echo "OUTPUT_DIRECTORY = $out") | doxygen -
echo "API reference: $out/html/index.html"

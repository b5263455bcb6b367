#!/usr/bin/env bash
# Copies this working tree into DEST (a folder inside a build root: scripts/compat.sh's
# /src/paratrain): what git tracks or would track here. A file whose
# content DEST already has is left as it is there, time included, so that the root's build
# recompiles only what changed, also from a fresh clone (CI's), whose files are all new to the
# clock; a file gone here goes there too. Uses sudo where not root (DEST belongs to root).
# Usage: scripts/sync-into-root.sh DEST
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:?usage: scripts/sync-into-root.sh DEST}
sudo=()
((EUID == 0)) || sudo=(sudo)
listed=$(mktemp)
trap 'rm -f "$listed"' EXIT
"${sudo[@]}" mkdir -p "$dest"
git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
  [[ -f $f ]] || continue
  if ! cmp -s "$f" "$dest/$f"; then
    "${sudo[@]}" mkdir -p "$dest/$(dirname "$f")"
    "${sudo[@]}" cp "$f" "$dest/$f"
  fi
  printf '%s\n' "$f"
done | sort >"$listed"
(cd "$dest" && find . -type f | sed 's|^\./||' | sort) |
  comm -23 - "$listed" | while IFS= read -r gone; do "${sudo[@]}" rm -f "$dest/$gone"; done

#!/usr/bin/env python3
"""The README shows the program `ctest -L quickstart` builds, and its table every alias it
builds it with: README.md holds examples/quickstart/main.cpp verbatim as a ```cpp block, and
each alias of examples/quickstart/aliases.txt in a table row, in the file's order.

Usage: check_quickstart.py SOURCE_DIR
"""
import pathlib
import re
import sys


def main(root):
    readme = (root / "README.md").read_text()
    program = (root / "examples/quickstart/main.cpp").read_text()
    problems = []
    blocks = re.findall(r"^```(?:cpp|c\+\+)\n(.*?)^```", readme, re.S | re.M)
    if program not in blocks:
        problems.append("README.md has no ```cpp block equal to examples/quickstart/main.cpp (copy it again)")
    rows = [line.split("|", 1) for line in (root / "examples/quickstart/aliases.txt").read_text().splitlines()
            if line and not line.startswith("#")]
    table = [line for line in readme.splitlines() if line.startswith("|")]
    where = []
    for name, alias in rows:
        hits = [i for i, line in enumerate(table) if f"`{alias}`" in line]
        if not hits:
            problems.append(f"README.md's table has no row with `{alias}` ({name})")
        else:
            where.append(hits[0])
    if where != sorted(where):
        problems.append("README.md's table lists the aliases in another order than examples/quickstart/aliases.txt")
    for p in problems:
        print("check_quickstart:", p)
    if not problems:
        print(f"check_quickstart: README.md shows examples/quickstart/main.cpp and its {len(rows)} aliases")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")))

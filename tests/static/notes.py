#!/usr/bin/python3
"""The Note check: every `Note [Title]` cited anywhere in the project has exactly one
definition, and every definition is cited or stands in a header.

A definition is a comment line that holds the title and nothing else, the way GHC and
PyTorch write them, so that `grep -rn '// Note \\[Title\\]$'` finds it:

    // Note [Title]
    // The explanation, as many lines as it needs.

Every other mention of `Note [Title]` is a citation.
Usage: notes.py [ROOT]   (default: this repository)
"""
import pathlib
import re
import sys

DEFINITION = re.compile(r"^\s*(?://+|#+)\s*Note \[([^\]]+)\]\s*$")
CITATION = re.compile(r"Note \[([^\]]+)\]")
# Folders of the project's own text; build trees and data are not read.
SOURCES = ["include", "tests", "examples", "benchmarks", "tools", "cmake", "scripts", "docs", "fuzz",
           "test_package", ".ci"]
TOP_FILES = ["README.md", "CMakeLists.txt", "conanfile.py"]
SUFFIXES = {".hpp", ".cpp", ".h", ".py", ".sh", ".cmake", ".txt", ".md", ".in", ""}


def files(root):
    for top in TOP_FILES:
        if (root / top).is_file():
            yield root / top
    for folder in SOURCES:
        base = root / folder
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*")):
            if path.is_file() and path.suffix in SUFFIXES and "data" not in path.relative_to(root).parts[:2]:
                yield path


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parents[2])
    definitions, citations = {}, {}
    for path in files(root):
        try:
            lines = path.read_text().splitlines()
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(lines, 1):
            where = f"{path.relative_to(root)}:{n}"
            d = DEFINITION.match(line)
            if d:
                definitions.setdefault(d.group(1), []).append(where)
                continue
            for title in CITATION.findall(line):
                if "{" in title:  # a format string, as in this file
                    continue
                citations.setdefault(title, []).append(where)
    problems = []
    for title, places in sorted(citations.items()):
        if title not in definitions:
            problems.append(f"{places[0]}: cites Note [{title}], which has no definition "
                            f"(a comment line `// Note [{title}]` alone); cited {len(places)} time(s)")
    for title, places in sorted(definitions.items()):
        if len(places) > 1:
            problems.append(f"{places[1]}: defines Note [{title}] again (first at {places[0]})")
    for p in problems:
        print(p)
    if problems:
        print(f"notes: {len(problems)} problem(s); {len(definitions)} notes defined, "
              f"{sum(map(len, citations.values()))} citations")
        return 1
    print(f"notes: {len(definitions)} notes, each defined once; {sum(map(len, citations.values()))} citations, "
          "each of a defined note")
    return 0


if __name__ == "__main__":
    sys.exit(main())

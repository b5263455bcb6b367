#!/usr/bin/python3
"""The library walks no directory with std::filesystem: remove_all, directory_iterator and
recursive_directory_iterator are bound, in a program linked with a pip-installed LibTorch, to
the copies PyTorch's wheels export from the libstdc++ inside libtorch_cpu.so, and the LibTorch
of PyTorch 2.11 crashed in remove_all (Note [No recursive std::filesystem],
include/paratrain/checkpoint/files.hpp). checkpoint::detail::remove_tree and entries do it
with POSIX calls instead. Fails, naming the file and line, on any header under include/ that
calls one outside a comment.

Usage: filesystem.py [ROOT]   (default: this repository)
"""
import pathlib
import re
import sys

import report

CALLS = re.compile(r"\b(remove_all|recursive_directory_iterator|directory_iterator)\b")


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parents[2])
    headers = sorted((root / "include").rglob("*.hpp"))
    problems = []
    for path in headers:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("//", 1)[0]
            m = CALLS.search(code)
            if m:
                problems.append(f"{path.relative_to(root)}:{n}: calls std::filesystem's {m.group(1)}; use "
                                "checkpoint::detail::remove_tree or entries (Note [No recursive std::filesystem])")
    return report.finish(problems, f"filesystem: {len(headers)} headers, {len(problems)} walking a directory with "
                                   "std::filesystem")


if __name__ == "__main__":
    sys.exit(main())

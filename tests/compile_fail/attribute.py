#!/usr/bin/python3
"""One compile-fail case's verdict, from the compiler's output for every case in one TU.

usage: attribute.py LOG CASE REGEX

LOG is what the compiler said of the TU that holds every case of tests/compile_fail/, each in a
namespace of its own (compile_fail_<name>) under a #line naming its file (Note [Compile-fail cases
in one translation unit], tests/CMakeLists.txt). CASE is the case's file, REGEX its `// expect:`.

A diagnostic belongs to the case named last before it, by its file (a location in it) or its
namespace: GCC prints a template's instantiation context, which ends at the line of the case that
asked for it, whenever that context changes, and a case's own errors are located in its file. The
case passes when an error is attributed to it and its diagnostics (errors, their notes and
context) match REGEX.
"""
import re
import sys
from pathlib import Path


def main():
    log, case, expect = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    if not log.exists():
        print(f"attribute.py: {log} is missing: the test compile_fail.all_cases did not run")
        return 1
    name = case.stem
    mention = re.compile(r"/compile_fail/(\w+)\.cpp:|\bcompile_fail_(\w+)::")
    current, mine = None, []
    for line in log.read_text(errors="replace").splitlines():
        m = mention.search(line)
        if m:
            current = m.group(1) or m.group(2)
        if current == name:
            mine.append(line)
    text = "\n".join(mine)
    errors = [l for l in mine if " error: " in l]
    if not errors:
        print(f"compile_fail.{name}: no error of the merged compile is this case's: it compiles, but it must not")
        print("\n".join(mine[-40:]))
        return 1
    found = re.search(expect, text)
    if not found:
        print(f"compile_fail.{name}: it fails to compile, but without the expected message\n  {expect}\n"
              "its diagnostics:")
        print(text[-6000:])
        return 1
    print(f"compile_fail.{name}: fails to compile, as expected, with: {found.group(0)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

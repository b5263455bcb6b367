#!/usr/bin/python3
"""Every test has a TIMEOUT (a test that hangs must fail, not hang CI): reads the build
tree's tests through `ctest --show-only=json-v1` and lists those without one. CMake gives
each test that sets none PARATRAIN_DEFAULT_TEST_TIMEOUT (cmake/ParatrainMpiTest.cmake).

Usage: timeouts.py CTEST BUILD_DIR
"""
import json
import subprocess
import sys


def main():
    ctest, build = sys.argv[1], sys.argv[2]
    shown = subprocess.run([ctest, "--show-only=json-v1"], cwd=build, capture_output=True, text=True, check=True)
    tests = json.loads(shown.stdout)["tests"]
    missing = [t["name"] for t in tests if not any(p["name"] == "TIMEOUT" for p in t.get("properties", []))]
    for name in missing:
        print(f"{name}: no TIMEOUT")
    print(f"timeouts: {len(tests)} tests, {len(missing)} without a TIMEOUT")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())

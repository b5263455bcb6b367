#!/usr/bin/python3
"""The project names no package-registry host: apt, mmdebstrap and the other tools take
their configured defaults (a mirror of one's own goes in an environment variable, as
scripts/compat.sh's PARATRAIN_COMPAT_MIRROR). Fails, naming the file and line, on any
tracked file that spells one.

Usage: hosts.py [ROOT]   (default: this repository)
"""
import pathlib
import re
import subprocess
import sys

import report

HOSTS = re.compile(r"(deb\.debian\.org|security\.debian\.org|ftp\.[a-z]+\.debian\.org|archive\.ubuntu\.com|"
                   r"pypi\.org|pypi\.python\.org|files\.pythonhosted\.org|registry\.npmjs\.org|center\.conan\.io|"
                   r"center2\.conan\.io)")


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parents[2])
    listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True, check=False)
    if listed.returncode != 0:  # not a git checkout (an unpacked archive): every file under the root
        files = [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and ".git" not in p.parts]
    else:
        files = [f for f in listed.stdout.decode().split("\0") if f]
    problems = []
    for name in files:
        if name == "tests/static/hosts.py":
            continue
        try:
            lines = (root / name).read_text().splitlines()
        except (UnicodeDecodeError, OSError):
            continue
        for n, line in enumerate(lines, 1):
            m = HOSTS.search(line)
            if m:
                problems.append(f"{name}:{n}: names the package registry {m.group(1)}; leave the tool its default")
    return report.finish(problems, f"hosts: {len(files)} files, {len(problems)} naming a registry host")


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Extracts every C++ block of README.md and docs/*.md into translation units that ctest
compiles (docs/testing.md, "Code in the docs").

Usage: extract_blocks.py SOURCE_DIR OUT.cpp   writes the translation unit
       extract_blocks.py SOURCE_DIR --check   lists every block and what becomes of it;
                                              fails on a marker it does not know

A block (```cpp or ```c++) is compiled unless the line before its fence is a marker:
  <!-- fragment: why -->     not compiled (a synopsis, part of an initializer, ...)
  <!-- statements -->        compiled as the body of a function
Otherwise the block is a file of its own: its #include lines go to the top of the
translation unit, the rest into `namespace doc_<page>_<line> { ... }`. The names a block
may use without declaring them (Net, train, strategy, ...) are tests/docs/blocks_prelude.hpp's.

All blocks go into one translation unit (each costs a LibTorch parse: ~50 s for all
blocks together, 26-45 s for as few as one or two). A block that needs a component (gloo, hdf5,
nccl; core blocks need comm::Mpi) stands inside `#if PARATRAIN_HAS_<COMPONENT>`, defined by the
component's target: where it is missing the block is left out, and CMake says so.
"""
import pathlib
import re
import sys

FENCE = re.compile(r"^(\s*)```(cpp|c\+\+)\s*$")
ANY_FENCE = re.compile(r"^\s*```")
MARKER = re.compile(r"^\s*<!--\s*(fragment|statements)\b\s*(?::\s*(.*?))?\s*-->\s*$")
ANY_COMMENT = re.compile(r"^\s*<!--.*-->\s*$")
GROUPS = ("core", "gloo", "hdf5", "nccl")


class Block:
    def __init__(self, page, line, kind, reason, code):
        self.page, self.line, self.kind, self.reason, self.code = page, line, kind, reason, code

    @property
    def group(self):
        if re.search(r"comm/nccl/|comm::Nccl|\bcuda[A-Z]", self.code):
            return "nccl"
        if re.search(r"comm/gloo/|comm::Gloo", self.code):
            return "gloo"
        if re.search(r"data/hdf5/|Hdf5Dataset", self.code):
            return "hdf5"
        return "core"


def pages(root):
    yield root / "README.md"
    yield from sorted((root / "docs").glob("*.md"))


def blocks(root, errors):
    for page in pages(root):
        rel = page.relative_to(root).as_posix()
        lines = page.read_text(encoding="utf-8").split("\n")
        i = 0
        while i < len(lines):
            m = FENCE.match(lines[i])
            if not m:
                if ANY_FENCE.match(lines[i]):  # another language's block: skip past it
                    i += 1
                    while i < len(lines) and not ANY_FENCE.match(lines[i]):
                        i += 1
                i += 1
                continue
            indent = len(m.group(1))
            start = i + 1
            j = start
            while j < len(lines) and not re.match(r"^\s*```\s*$", lines[j]):
                j += 1
            if j == len(lines):
                errors.append(f"{rel}:{i + 1}: the block never ends (no closing ```)")
                return
            kind, reason = "file", None
            before = lines[i - 1] if i > 0 else ""
            mk = MARKER.match(before)
            if mk:
                kind, reason = mk.group(1), mk.group(2)
                if kind == "fragment" and not reason:
                    errors.append(f"{rel}:{i}: say why the block is a fragment: <!-- fragment: why -->")
            elif ANY_COMMENT.match(before):
                errors.append(f"{rel}:{i}: unknown marker {before.strip()!r}: "
                              "use <!-- fragment: why --> or <!-- statements -->")
            code = "\n".join(l[indent:] if l[:indent].strip() == "" else l for l in lines[start:j])
            yield Block(rel, start + 1, kind, reason, code)
            i = j + 1


GUARD = {"gloo": "PARATRAIN_HAS_GLOO", "hdf5": "PARATRAIN_HAS_HDF5", "nccl": "PARATRAIN_HAS_NCCL"}


def translation_unit(root, chosen):
    """One translation unit for all blocks: LibTorch is parsed once. A block that needs a
    component stands inside `#if PARATRAIN_HAS_<COMPONENT>`, which the component's target
    defines: where it is missing, the block is left out (CMake says so at configure)."""
    includes = {g: [] for g in GROUPS}
    bodies = []
    for b in chosen:
        name = "doc_" + re.sub(r"\W", "_", pathlib.PurePosixPath(b.page).stem) + f"_{b.line}"
        body = []
        for l in b.code.split("\n"):
            if l.startswith("#include"):
                if all(l not in v for v in includes.values()):
                    includes[b.group].append(l)
                l = ""  # keeps the line numbers
            body.append(l)
        path = (root / b.page).as_posix()
        open_fn, close_fn = ("[[maybe_unused]] void block() {\n", "\n}") if b.kind == "statements" else ("", "")
        text = (f"namespace {name} {{\n{open_fn}#line {b.line} \"{path}\"\n" + "\n".join(body)
                + f"{close_fn}\n}}  // namespace {name}")
        if b.group in GUARD:
            text = f"#if {GUARD[b.group]}\n{text}\n#endif"
        bodies.append(text)
    head = [f"// Generated by tests/docs/extract_blocks.py from README.md and docs/*.md: {len(chosen)} "
            "blocks. Do not edit."]
    head += includes["core"]
    for g in GUARD:
        if includes[g]:
            head += [f"#if {GUARD[g]}"] + includes[g] + ["#endif"]
    return "\n".join(head) + "\n#include \"blocks_prelude.hpp\"\n\n" + "\n\n".join(bodies) + "\n"


def main(argv):
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    root = pathlib.Path(argv[1]).resolve()
    errors = []
    found = list(blocks(root, errors))
    if errors:
        print("\n".join(errors), file=sys.stderr)
        return 1
    if argv[2] == "--check":
        counts = {}
        for b in found:
            what = ("fragment: " + b.reason) if b.kind == "fragment" else f"compiled ({b.kind}, {b.group} group)"
            print(f"{b.page}:{b.line}: {what}")
            key = "fragment" if b.kind == "fragment" else b.group
            counts[key] = counts.get(key, 0) + 1
        print(f"{len(found)} blocks: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
        return 0
    target = pathlib.Path(argv[2])
    target.parent.mkdir(parents=True, exist_ok=True)
    text = translation_unit(root, [b for b in found if b.kind != "fragment"])
    if not target.exists() or target.read_text() != text:  # unchanged: nothing recompiles
        target.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

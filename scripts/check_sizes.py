#!/usr/bin/env python3
"""Keeps the Rust tree readable: fails when a .rs file has more than 700 lines of code before its
tests, or a function runs over 80 lines without saying at its top why ("Long on purpose: ...").

A line of code is a line that is neither blank nor a comment (`//`, `///`, `//!`); "before its
tests" is before the file's first `#[cfg(test)]`. A function's length is its lines from `fn` to
its closing brace. Functions in test code (after `#[cfg(test)]`, or under a `tests/` directory)
are not measured. Files in ALLOWED are reported, not failed, until they are split: the lead
removes an entry once its file is under the limit.
    python3 scripts/check_sizes.py [--list]   (--list: print every file and function measured)
"""

import pathlib
import re
import sys

MAX_FILE_CODE = 700
MAX_FN_LINES = 80
REASON = "Long on purpose"
# Path (or folder, ending in /) -> why it is reported, not failed. Remove an entry once its
# files are within the limits.
ALLOWED: dict[str, str] = {}


def allowed(rel):
    """Why `rel` is reported rather than failed, or None."""
    for key, why in ALLOWED.items():
        if rel == key or (key.endswith("/") and rel.startswith(key)):
            return why
    return None
ROOT = pathlib.Path(__file__).resolve().parent.parent
FN = re.compile(
    r"^\s*(?:pub(?:\([^)]*\))?\s+)?(?:const\s+)?(?:async\s+)?(?:unsafe\s+)?"
    r"(?:extern\s+\"[^\"]*\"\s+)?fn\s+(\w+)"
)
# Strings, raw strings, char literals and comments, so a brace inside them is not counted.
TOKEN = re.compile(
    r'//[^\n]*|/\*.*?\*/|r(#*)".*?"\1|b?"(?:\\.|[^"\\])*"|b?\'(?:\\.|[^\\\'])\'|[{};]',
    re.S,
)


def test_start(lines):
    """Index of the first `#[cfg(test)]` line, or len(lines)."""
    for i, line in enumerate(lines):
        if line.strip().startswith("#[cfg(test)]"):
            return i
    return len(lines)


def code_lines(lines):
    return sum(1 for line in lines if line.strip() and not line.strip().startswith("//"))


def functions(text, end_line):
    """(name, first line, line count, reason given) of each fn with a body before end_line."""
    offsets = [0]
    for line in text.splitlines(keepends=True):
        offsets.append(offsets[-1] + len(line))
    lines = text.splitlines()
    tokens = [(m.start(), m.group(0)) for m in TOKEN.finditer(text) if m.group(0) in "{};"]
    out = []
    for i, line in enumerate(lines[:end_line]):
        m = FN.match(line)
        if not m or line.lstrip().startswith("//"):
            continue
        start = offsets[i] + m.end()
        depth, open_at = 0, None
        for pos, tok in tokens:
            if pos < start:
                continue
            if tok == ";" and open_at is None:
                break  # a declaration without a body
            if tok == "{":
                depth += 1
                open_at = open_at if open_at is not None else pos
            elif tok == "}":
                depth -= 1
                if depth == 0 and open_at is not None:
                    last = text.count("\n", 0, pos)
                    n = last - i + 1
                    above = []
                    j = i - 1
                    while j >= 0 and lines[j].strip().startswith(("///", "#[", "//")):
                        above.append(lines[j])
                        j -= 1
                    body_top = lines[i : i + 6]
                    reason = any(REASON in x for x in above + body_top)
                    out.append((m.group(1), i + 1, n, reason))
                    break
    return out


def main():
    listing = "--list" in sys.argv[1:]
    failures, reports = [], []
    for path in sorted(ROOT.glob("**/*.rs")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("target/") or "/target/" in rel:
            continue
        text = path.read_text()
        lines = text.splitlines()
        end = test_start(lines)
        why = allowed(rel)

        def note(msg, why=why):
            (reports if why else failures).append(msg + (f" [allowed: {why}]" if why else ""))

        n = code_lines(lines[:end])
        if listing:
            print(f"{n:5} {rel}")
        if n > MAX_FILE_CODE:
            msg = f"{rel}: {n} lines of code before its tests (limit {MAX_FILE_CODE}): split it along a seam"
            note(msg)
        if "tests" in pathlib.PurePosixPath(rel).parts:
            continue
        for name, line, count, reason in functions(text, end):
            if listing and count > MAX_FN_LINES:
                print(f"      fn {name} line {line}: {count} lines{' (reason given)' if reason else ''}")
            if count > MAX_FN_LINES and not reason:
                msg = (
                    f"{rel}:{line}: fn {name} is {count} lines (limit {MAX_FN_LINES}): split it, "
                    f"or say at its top why it is long (\"{REASON}: ...\")"
                )
                note(msg)
    for msg in reports:
        print("note:", msg)
    for msg in failures:
        print("error:", msg, file=sys.stderr)
    if failures:
        sys.exit(1)
    print(f"check_sizes: every .rs file within {MAX_FILE_CODE} lines of code before its tests, "
          f"every function within {MAX_FN_LINES} lines or saying why ({len(reports)} allowed)")


if __name__ == "__main__":
    main()

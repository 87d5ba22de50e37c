#!/usr/bin/env python3
"""Holds ratelimit-core's modules to their floors (`make lint` runs it): a module may use only
the modules on the floors below its own, so that the crate's arrows all run downward and no two
modules need each other.

Every path from a module of crates/ratelimit-core/src to another is read: `use crate::x`, the
names of a `use crate::{x, y::z}` group, a `crate::x::…` path in code, and a `super::…` path
that climbs to the crate's root (comments and string literals are not code). A path to a module on
the same floor or a higher one is printed, `file:line: who (floor) uses what (floor): the line`,
and the check fails. Test code (an item under `#[cfg(test)]`, with the files its modules
declare) keeps the same order, and may also use the test kit. A module that no floor names fails
the check too, so that a new module is given its floor. Python 3, standard library only."""

import re
import sys
from pathlib import Path

# ANCHOR: floors
# The floors, lowest first. A module may use the modules of the floors below its own.
FLOORS = [
    # Leaves: they use no other module of the crate.
    ["error", "seed", "http", "limiter", "usage"],
    # The table's layout, elastic limits, rate limit services' messages, what providers say,
    # what is counted.
    ["table", "elastic", "rls", "provider", "metrics"],
    # A capacity shared among tenants; the store of per-key state.
    ["share", "store"],
    # The typed rules, read from JSON.
    ["config"],
    # Over the rules: keys, the fields a client is told, the engine.
    ["key", "headers", "engine"],
    # Global rules over their services; answers in an LLM API's dialect.
    ["global", "dialect"],
    # A configuration ready to serve, and what happens to its requests.
    ["runtime"],
    # A fake host and fixtures, for tests (other crates' too, behind the feature `testkit`).
    ["testkit"],
]
# ANCHOR_END: floors
# The module that test code on any floor may use as well.
TEST_KIT = "testkit"

SRC = Path(__file__).resolve().parent / "src"
ROOT = SRC.parents[2]

# A character literal (a `'` that starts none is a lifetime's).
CHAR = re.compile(r"b?'(?:\\(?:u\{[0-9a-fA-F]{1,6}\}|x[0-9a-fA-F]{2}|.)|[^\\'\n])'")
RAW_STRING = re.compile(r'b?r(#*)"')
TEST_ATTR = re.compile(r"#\[cfg\(test\)\]\s*(?:#\[[^\]]*\]\s*)*")
MOD = re.compile(r"\b(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*([{;])")
# `crate::x`, `crate::{…}` or `super::…::x` (not `$crate`, not the end of a longer name).
PATH = re.compile(r"(?<![\w$])(?:(crate)|((?:super\s*::\s*)*super))\s*::\s*(\{|\w+)")


def code_of(text):
    """`text` with its comments and the contents of its string and character literals blanked
    (newlines kept, so that an offset keeps its line)."""
    out, i, n = [], 0, len(text)

    def blank(end):
        out.append(re.sub(r"[^\n]", " ", text[i:end]))
        return end

    while i < n:
        after_name = i > 0 and (text[i - 1].isalnum() or text[i - 1] == "_")
        if text.startswith("//", i):
            end = text.find("\n", i)
            i = blank(n if end < 0 else end)
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                step = 1 + (text[j : j + 2] in ("/*", "*/"))
                depth += {"/*": 1, "*/": -1}.get(text[j : j + 2], 0)
                j += step
            i = blank(j)
        elif not after_name and (m := RAW_STRING.match(text, i)):
            end = text.find('"' + m.group(1), m.end())
            i = blank(n if end < 0 else end + 1 + len(m.group(1)))
        elif not after_name and (text[i] == '"' or text.startswith('b"', i)):
            j = text.index('"', i) + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            i = blank(j + 1)
        elif not after_name and (m := CHAR.match(text, i)):
            i = blank(m.end())
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def item_end(code, start):
    """Where the item that begins at `start` ends: after its first `;` outside braces, or after
    the `}` that closes its first `{`."""
    depth = 0
    for j in range(start, len(code)):
        if code[j] == "{":
            depth += 1
        elif code[j] == "}":
            depth -= 1
            if depth == 0:
                return j + 1
        elif code[j] == ";" and depth == 0:
            return j + 1
    return len(code)


def module_of(path):
    """The module of the crate's root that a file belongs to (`None`: the root itself)."""
    first = path.relative_to(SRC).parts[0]
    return None if first == "lib.rs" else first.removesuffix(".rs")


def declared_file(path, name):
    """The file that a `mod name;` in `path` stands for."""
    folder = path.parent if path.name in ("lib.rs", "mod.rs") else path.with_suffix("")
    return next((f for f in (folder / f"{name}.rs", folder / name / "mod.rs") if f.exists()), None)


class Source:
    """One file: its code, its inline modules and its test items (as offset ranges), and the
    files its test modules declare."""

    def __init__(self, path):
        self.path = path
        self.lines = path.read_text().split("\n")
        self.code = code_of(path.read_text())
        self.inline = [
            (m.start(), item_end(self.code, m.start()))
            for m in MOD.finditer(self.code)
            if m.group(2) == "{"
        ]
        self.tests, self.test_files = [], []
        for m in TEST_ATTR.finditer(self.code):
            self.tests.append((m.start(), item_end(self.code, m.end())))
            d = MOD.match(self.code, m.end())
            if d and d.group(2) == ";":
                self.test_files.append(declared_file(path, d.group(1)))

    def uses(self):
        """(module, offset) for each path to a module of the crate's root."""
        depth = len(self.path.relative_to(SRC).with_suffix("").parts) - (self.path.name == "mod.rs")
        for m in PATH.finditer(self.code):
            if m.group(2):  # `super::` reaches the root only from as deep as it climbs
                level = depth + sum(a < m.start() < b for a, b in self.inline)
                if m.group(2).count("super") != level:
                    continue
            if m.group(3) == "{":
                yield from group_heads(self.code, m.start(3))
            else:
                yield m.group(3), m.start(3)

    def line(self, offset):
        return self.code.count("\n", 0, offset) + 1


def group_heads(code, open_at):
    """The first name of each element of the `{…}` group opened at `open_at`, with its offset."""
    depth, expect = 0, True
    for j in range(open_at, len(code)):
        c = code[j]
        if c in "{}":
            depth += 1 if c == "{" else -1
            expect = c == "{" and depth == 1
            if depth == 0:
                return
        elif c == "," and depth == 1:
            expect = True
        elif expect and depth == 1 and (c.isalpha() or c == "_"):
            yield re.match(r"\w+", code[j:]).group(0), j
            expect = False


def main():
    floor = {m: i + 1 for i, mods in enumerate(FLOORS) for m in mods}
    here = Path(__file__).resolve().relative_to(ROOT)
    sources = {f: Source(f) for f in sorted(SRC.rglob("*.rs"))}
    errors = []
    modules = {module_of(f) for f in sources} - {None}
    for m in sorted(modules - floor.keys()):
        errors.append(f"{here}: the module {m} is on no floor: give it one")
    for m in sorted(floor.keys() - modules):
        errors.append(f"{here}: a floor names {m}, no module of the crate")

    # Test files: those a test module declares, and the files of their own folders.
    test_files = {t for s in sources.values() for t in s.test_files if t}
    folders = [t.parent if t.name == "mod.rs" else t.with_suffix("") for t in test_files]
    test_files |= {f for f in sources if any(d in f.parents for d in folders)}

    for f, s in sources.items():
        who = module_of(f)
        if who not in floor:
            continue
        for what, at in s.uses():
            if what == who or what not in floor or floor[what] < floor[who]:
                continue
            if what == TEST_KIT and (f in test_files or any(a <= at < b for a, b in s.tests)):
                continue
            n = s.line(at)
            errors.append(
                f"{f.relative_to(ROOT)}:{n}: {who} (floor {floor[who]}) uses {what} "
                f"(floor {floor[what]}): {s.lines[n - 1].strip()}"
            )
    for e in errors:
        print(e, file=sys.stderr)
    if errors:
        print(f"{here}: {len(errors)} against the floors", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())

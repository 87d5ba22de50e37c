#!/usr/bin/env python3
"""Checks the documentation's links (no Envoy needed; `make docs` runs it): every relative link
of README.md and docs/src/**/*.md resolves to a file of the repository, every `#anchor` to a
heading of the target page (mdBook's ids: lowercased, spaces to `-`, punctuation other than `-`
and `_` dropped, a repeated heading `-1`, `-2`, ...) or an HTML `id`; every page of docs/src is
listed in SUMMARY.md and every SUMMARY entry is a page that exists. `{{#include}}`s are expanded first.
Links inside code (fenced blocks, `inline code`) are not links; a link's text may run over
several lines.

A book page (docs/src) links outside the book only through the repository's URL: relatively,
to a file of the repository, which the repo-links preprocessor (repo_links.py) turns into a
link under book.toml's `git-repository-url`; never to that URL by hand (the base would then be
written twice) and never outside the repository. `--built DIR` checks the built book instead:
no relative `href` or `src` of DIR's pages leads outside DIR. Python 3.11, standard library."""

import os
import re
import sys
import tomllib
from pathlib import Path

from repo_links import links, rewrite

ROOT = Path(__file__).resolve().parent.parent.parent
SRC = ROOT / "docs/src"
INCLUDE = re.compile(r"\{\{#include\s+([^}]+?)\s*\}\}")


def expand(path, text):
    def repl(m):
        arg = m.group(1)
        target, anchor = arg, None
        if ":" in arg:
            head, tail = arg.rsplit(":", 1)
            if tail and not tail.replace("-", "").isdigit():
                target, anchor = head, tail
        body = (path.parent / target).read_text()
        lines = body.splitlines()
        if anchor:
            out, inside = [], False
            for l in lines:
                if re.search(rf"ANCHOR:\s*{re.escape(anchor)}\b", l):
                    inside = True
                elif re.search(rf"ANCHOR_END:\s*{re.escape(anchor)}\b", l):
                    inside = False
                elif inside and "ANCHOR" not in l:
                    out.append(l)
            lines = out
        return "\n".join(l for l in lines if "ANCHOR:" not in l and "ANCHOR_END:" not in l)
    return INCLUDE.sub(repl, text)


def outside_fences(text):
    """The page's lines, those of fenced blocks (fences included) made empty, so that line
    numbers stay."""
    out, fence = [], None
    for line in text.splitlines():
        s = line.lstrip()
        m = re.match(r"(`{3,}|~{3,})", s)
        if fence is None and m:
            fence = m.group(1)
            out.append("")
        elif fence is not None:
            if s.startswith(fence) and not s[len(fence):].strip():
                fence = None
            out.append("")
        else:
            out.append(line)
    return out


def prose(text):
    """The text outside fenced blocks and inline code."""
    return "\n".join(re.sub(r"(`+)(.+?)\1", "", line) for line in outside_fences(text))


def slug(heading):
    """mdBook's id for a heading's text."""
    text = re.sub(r"<[^>]+>", "", heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = text.replace("`", "").strip().lower()
    return "".join(c for c in text.replace(" ", "-") if c.isalnum() or c in "-_")


def anchors(path, cache={}):
    if path not in cache:
        text = path.read_text()
        if path.suffix == ".md":
            text = expand(path, text)
        ids, counts = set(), {}
        for line in outside_fences(text):
            m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
            if m:
                h = m.group(1)
                custom = re.search(r"\{#([^}\s]+)[^}]*\}\s*$", h)
                if custom:
                    ids.add(custom.group(1))
                    continue
                s = slug(h)
                n = counts.get(s, 0)
                counts[s] = n + 1
                ids.add(s if n == 0 else f"{s}-{n}")
        ids.update(re.findall(r"""\bid=["']([^"']+)["']""", text))
        cache[path] = ids
    return cache[path]


def book_base():
    """The repository's URL the built book links through (book.toml)."""
    cfg = tomllib.loads((ROOT / "docs/book.toml").read_text())
    return cfg["output"]["html"]["git-repository-url"].rstrip("/")


def check_built(book):
    """Errors: relative `href`s and `src`s of the built book's pages that lead outside it."""
    errors, n = [], 0
    root = book.resolve()
    for page in sorted(root.rglob("*.html")):
        for m in re.finditer(r"""\b(?:href|src)=["']([^"'#?]*)""", page.read_text(errors="replace")):
            url = m.group(1)
            if not url or re.match(r"^[a-z][a-z0-9+.-]*:|^/", url, re.I):
                continue  # a URL, or a path from the site's root (mdBook's 404 page)
            n += 1
            dest = Path(os.path.normpath(page.parent / url))
            if dest != root and root not in dest.parents:
                errors.append(f"{page.relative_to(root)}: {url}: leads outside the book")
    return errors, n


def main():
    if sys.argv[1:2] == ["--built"]:
        errors, n = check_built(Path(sys.argv[2]))
        for e in errors:
            print(e, file=sys.stderr)
        print(f"built book: {n} relative links checked, {len(errors)} leading outside it")
        return 1 if errors else 0
    errors = []
    base = book_base()
    pages = [ROOT / "README.md"] + sorted(SRC.rglob("*.md"))
    count = 0
    for page in pages:
        text = expand(page, page.read_text())
        in_book = SRC in page.parents
        for start, _, url in links(text):
            where = f"{page.relative_to(ROOT)}:{text.count(chr(10), 0, start) + 1}"
            if in_book and (url == base or url.startswith(base + "/")):
                errors.append(f"{where}: {url}: link to the repository's file relatively (the build "
                              f"adds the base, book.toml's git-repository-url)")
                continue
            if re.match(r"^[a-z][a-z0-9+.-]*:", url, re.I):
                continue  # http:, https:, mailto:
            count += 1
            target, _, frag = url.partition("#")
            dest = (page.parent / target).resolve() if target else page
            if not dest.exists():
                errors.append(f"{where}: {url}: no such file")
                continue
            if in_book and dest != ROOT and ROOT not in dest.parents:
                errors.append(f"{where}: {url}: outside the repository")
                continue
            if frag and dest.is_file() and dest.suffix in (".md", ".html"):
                if frag not in anchors(dest):
                    errors.append(f"{where}: {url}: no heading or id #{frag} in {dest.relative_to(ROOT)}")
        if in_book:
            # What the built page links to: inside the book, or under the base.
            built = rewrite(text, page.parent, SRC, ROOT, base, "REV")
            for start, _, url in links(built):
                if re.match(r"^[a-z][a-z0-9+.-]*:", url, re.I) or url.startswith("#"):
                    continue
                dest = (page.parent / url.partition("#")[0]).resolve()
                if dest != SRC and SRC not in dest.parents:
                    errors.append(f"{page.relative_to(ROOT)}: {url}: the built page would link outside the book")
    # SUMMARY.md and the pages.
    summary = SRC / "SUMMARY.md"
    listed = set()
    for n, line in enumerate(summary.read_text().splitlines(), 1):
        for m in re.finditer(r"\]\(([^)]*)\)", line):
            target = m.group(1)
            if not target:
                errors.append(f"docs/src/SUMMARY.md:{n}: a chapter without a page (a part's label "
                              f"needs a landing page)")
                continue
            listed.add((SRC / target).resolve())
            if not (SRC / target).exists():
                errors.append(f"docs/src/SUMMARY.md:{n}: {target}: no such page")
    for page in sorted(SRC.rglob("*.md")):
        if page != summary and page.resolve() not in listed:
            errors.append(f"{page.relative_to(ROOT)}: not in docs/src/SUMMARY.md")
    for e in errors:
        print(e, file=sys.stderr)
    print(f"links: {count} checked in {len(pages)} pages, {len(errors)} errors")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())

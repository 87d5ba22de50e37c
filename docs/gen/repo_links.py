#!/usr/bin/env python3
"""An mdBook preprocessor (docs/book.toml, `[preprocessor.repo-links]`): a link of a book page to
a file of the repository outside the book (`../../../examples/fleet/README.md`) becomes a link
to that file at the repository's URL (`<git-repository-url>/blob/<rev>/examples/fleet/README.md`,
`/tree/` for a folder). The pages keep relative links, which GitHub and a checkout resolve; the
built book, wherever it is served, links through one base: `[output.html] git-repository-url`
and `[preprocessor.repo-links] rev` of book.toml, which mdBook lets the environment override
(`MDBOOK_OUTPUT__HTML__GIT_REPOSITORY_URL`, `MDBOOK_PREPROCESSOR__REPO_LINKS__REV`).

Links inside code (fenced blocks, `inline code`) are left alone; a link into the book (into
docs/src) too. docs/gen/check_links.py uses `rewrite` to check every page. Python 3, standard
library only."""

import json
import os
import re
import sys
from pathlib import Path

# An inline link's target (its text may run over several lines), or a reference definition's.
LINK = re.compile(
    r"(!?\[[^\]]*\]\(\s*<?)([^)\s>]+)(>?(?:\s+\"[^\"]*\")?\s*\))|^(\s*\[[^\]]+\]:\s*)(\S+)()", re.M)
SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)
FENCE = re.compile(r"(`{3,}|~{3,})")


def mask(text):
    """`text` with its code (fenced blocks, fences included, and `inline code`) blanked out,
    every other character where it was."""
    out, fence = [], None
    for line in text.split("\n"):
        s = line.lstrip()
        m = FENCE.match(s)
        if fence is None and m:
            fence = m.group(1)
            out.append(" " * len(line))
        elif fence is not None:
            if s.startswith(fence) and not s[len(fence):].strip():
                fence = None
            out.append(" " * len(line))
        else:
            out.append(re.sub(r"(`+)(.+?)\1", lambda c: " " * len(c.group(0)), line))
    return "\n".join(out)


def links(text):
    """(start, end, target) of every link target outside code, in order."""
    out = []
    for m in LINK.finditer(mask(text)):
        g = 2 if m.group(2) is not None else 5
        start, end = m.span(g)
        out.append((start, end, text[start:end]))
    return out


def target_of(url, page_dir):
    """The path a relative link leads to, and its `#fragment` (with the `#`); None for a URL with
    a scheme or an anchor of the page itself."""
    if SCHEME.match(url) or url.startswith("#"):
        return None
    path, sep, frag = url.partition("#")
    return Path(os.path.normpath(page_dir / path)), sep + frag


def rewrite(text, page_dir, book_src, repo_root, base, rev):
    """`text` (a page in `page_dir`) with each link that leaves `book_src` for a file of
    `repo_root` turned into `<base>/blob|tree/<rev>/<path>`."""
    for start, end, url in reversed(links(text)):
        t = target_of(url, page_dir)
        if t is None:
            continue
        dest, frag = t
        if dest == book_src or book_src in dest.parents:
            continue
        if repo_root not in dest.parents:
            continue  # outside the repository: check_links reports it
        kind = "tree" if dest.is_dir() else "blob"
        new = f"{base.rstrip('/')}/{kind}/{rev}/{dest.relative_to(repo_root).as_posix()}{frag}"
        text = text[:start] + new + text[end:]
    return text


def settings(ctx):
    """(book's src, repository root, base URL, rev) from mdBook's context."""
    root = Path(ctx["root"]).resolve()
    cfg = ctx["config"]
    src = (root / cfg.get("book", {}).get("src", "src")).resolve()
    base = cfg.get("output", {}).get("html", {}).get("git-repository-url")
    if not base:
        sys.exit("repo-links: book.toml has no [output.html] git-repository-url")
    rev = cfg.get("preprocessor", {}).get("repo-links", {}).get("rev", "main")
    return src, root.parent, base, rev


def chapters(items):
    """Every chapter of the book (mdBook 0.5's `items`, 0.4's `sections`), sub-chapters too."""
    for item in items:
        ch = item.get("Chapter") if isinstance(item, dict) else None
        if ch:
            yield ch
            yield from chapters(ch.get("sub_items", []))


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "supports":
        return 0  # every renderer
    ctx, book = json.load(sys.stdin)
    src, repo, base, rev = settings(ctx)
    for ch in chapters(book.get("items", book.get("sections", []))):
        if ch.get("source_path"):
            page_dir = (src / ch["source_path"]).parent
            ch["content"] = rewrite(ch["content"], page_dir, src, repo, base, rev)
    json.dump(book, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())

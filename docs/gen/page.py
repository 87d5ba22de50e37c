"""What every page generator of docs/gen does with its page: write it, or with --check compare it."""

import sys
from pathlib import Path


def write_or_check(page: Path, text: str, root: Path, generator: str) -> int:
    """Writes `text` to `page`, or with --check on the command line returns 1 (and says so) if the
    committed page differs."""
    if "--check" in sys.argv[1:]:
        current = page.read_text() if page.exists() else None
        if current != text:
            print(f"{page.relative_to(root)} is not what {generator} writes: run `make docs-gen`",
                  file=sys.stderr)
            return 1
        return 0
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(text)
    print(f"wrote {page.relative_to(root)}")
    return 0

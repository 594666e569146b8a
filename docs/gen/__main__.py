"""`python -m docs.gen`: write the generated reference pages; `--check`: exit 1 if any is
stale, naming it (nothing written)."""

from __future__ import annotations

import argparse
import sys

from docs.gen import REGENERATE, REPO_ROOT, render_all, stale_pages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m docs.gen", description=__doc__)
    parser.add_argument("--check", action="store_true", help="only report stale pages")
    args = parser.parse_args(argv)
    pages = render_all()
    stale = stale_pages(pages)
    for path in stale:
        name = path.relative_to(REPO_ROOT)
        if args.check:
            print(f"stale: {name} (regenerate: {REGENERATE})", file=sys.stderr)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(pages[path])
            print(f"wrote {name}")
    if not stale:
        print(f"{len(pages)} generated pages up to date")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())

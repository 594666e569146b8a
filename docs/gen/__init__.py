"""The generated reference pages (`docs/reference/`), rendered from the code so they cannot
drift: `python -m docs.gen` writes them, `python -m docs.gen --check` lists stale ones
(`tests/docs/test_gen.py` fails on any)."""

from __future__ import annotations

import importlib
from pathlib import Path

from docs.gen.markdown import REGENERATE, REPO_ROOT

DOCS_DIR = REPO_ROOT / "docs"
# Each module has PAGE (a path under docs/) and render() -> the page's Markdown.
MODULES = (
    "docs.gen.cli_reference",
    "docs.gen.api_fields",
    "docs.gen.metrics_reference",
    "docs.gen.models_reference",
)


def render_all() -> dict[Path, str]:
    """Every generated page: its path and its text as the code stands now."""
    pages = {}
    for name in MODULES:
        module = importlib.import_module(name)
        pages[DOCS_DIR / module.PAGE] = module.render().rstrip("\n") + "\n"
    return pages


def stale_pages(pages: dict[Path, str] | None = None) -> list[Path]:
    """The generated pages whose file differs from what the code renders (or is missing)."""
    pages = render_all() if pages is None else pages
    return [p for p, text in pages.items() if not p.exists() or p.read_text() != text]


__all__ = ["REGENERATE", "render_all", "stale_pages"]

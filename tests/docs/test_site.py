"""The docs site builds with `mkdocs build --strict`: a broken link or anchor, a page
missing from the nav, or a snippet that is not there fails it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[docs]')")
    pytest.importorskip("material", reason="mkdocs-material is not installed")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    for page in ("reference/cli", "reference/api-fields", "reference/models", "benchmarks"):
        assert (tmp_path / page / "index.html").is_file(), page
    # The benchmarks page is benchmarks/README.md itself (a snippet), index included.
    benchmarks = (tmp_path / "benchmarks" / "index.html").read_text()
    assert "ops/decode_bound.py" in benchmarks

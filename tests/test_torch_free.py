"""The scheduler's and the search's tests run where torch cannot be imported (issue 28):
neither package, nor their tests, nor the conftest files above them import it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCKED = """
import sys
sys.modules["torch"] = None  # `import torch` raises ImportError from here on
import pytest
sys.exit(pytest.main(sys.argv[1:]))
"""


@pytest.mark.slow  # a second pytest run of the torch-free folders
def test_scheduler_and_search_tests_pass_with_torch_blocked():
    folders = ["tests/scheduler", "tests/search"]
    folders += [p for p in ["tests/test_imports.py"] if (ROOT / p).exists()]
    done = subprocess.run(
        [sys.executable, "-c", BLOCKED, "-q", "-p", "no:cacheprovider", "-m", "not slow",
         *folders],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout.splitlines()[-1]

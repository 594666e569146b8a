"""Every result file records how it was made: command, git revision, CPU and load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks.lib.common import REPO, git_revision, machine, write_result

PROGRAM = """
    import sys
    from pathlib import Path
    from benchmarks.lib.common import write_json
    write_json(Path(sys.argv[1]), {"answer": 42})
"""


def _run(args: list[str], cwd: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(cwd)])}
    subprocess.run([sys.executable, *args], cwd=cwd, env=env, check=True, timeout=120)
    return json.loads((cwd / "out.json").read_text())


@pytest.mark.slow  # two Python subprocesses that import torch
def test_a_result_records_the_command_that_runs_it_again(tmp_path):
    (tmp_path / "prog.py").write_text(textwrap.dedent(PROGRAM))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "prog.py").write_text(textwrap.dedent(PROGRAM))
    out = str(tmp_path / "out.json")
    as_script = _run(["prog.py", out, "--rounds", "2"], tmp_path)
    assert as_script["run"]["command"] == f"python prog.py {out} --rounds 2"
    assert as_script["answer"] == 42
    as_module = _run(["-m", "pkg.prog", out, "--label", "a b"], tmp_path)
    assert as_module["run"]["command"] == f"python -m pkg.prog {out} --label 'a b'"


def test_a_result_records_revision_cpu_flags_and_load(tmp_path, monkeypatch):
    import benchmarks.lib.common as common

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    record = json.loads(write_result("probe", {"rows": [1]}).read_text())
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                          text=True)  # fmt: skip
    if head.returncode == 0:
        assert record["run"]["git"]["commit"] == head.stdout.strip()
        assert isinstance(record["run"]["git"]["dirty"], bool)
    else:  # an unpacked archive, not a checkout
        assert record["run"]["git"] == {"commit": None, "dirty": None}
    load = record["run"]["load_average"]
    assert len(load) == 3 and all(x >= 0 for x in load)
    first = Path("/proc/cpuinfo").read_text().split("\n\n", 1)[0]
    flags = next(line for line in first.splitlines() if line.startswith("flags")).split()
    assert set(record["machine"]["cpu_flags"]) <= set(flags)
    assert ("avx2" in record["machine"]["cpu_flags"]) == ("avx2" in flags)
    assert ("avx512_bf16" in record["machine"]["cpu_flags"]) == ("avx512_bf16" in flags)
    assert record["machine"] == machine() and record["rows"] == [1]


def test_dirty_means_tracked_code_changed_not_results_or_untracked_files(tmp_path):
    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    assert git_revision(tmp_path) == {"commit": None, "dirty": None}  # not a checkout
    git("init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "old.json").write_text("{}\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    assert git_revision(tmp_path)["dirty"] is False
    (tmp_path / "benchmarks" / "results" / "old.json").write_text('{"new": 1}\n')
    (tmp_path / "scratch.txt").write_text("untracked\n")
    assert git_revision(tmp_path)["dirty"] is False
    (tmp_path / "code.py").write_text("x = 2\n")
    assert git_revision(tmp_path)["dirty"] is True

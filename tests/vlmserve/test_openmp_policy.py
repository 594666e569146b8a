"""The OpenMP wait policy each process gets (vlmserve/__init__.py): the engine commands
(`vlmserve serve`, `caption`, `generate`, `demo`) spin between parallel regions, everything
else waits passively, a user's own setting wins, and the preprocessing pool's workers wait
passively beside a spinning engine."""

import multiprocessing as mp
import os
import subprocess
import sys

import pytest

from encoders.preprocess_worker import _workers_wait_passively

KEYS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "VLMSERVE_SPIN_ENGINE_ONLY")


def _policy(argv: list[str], **user: str) -> tuple[str, str]:
    show = "print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))"
    code = f"import sys; sys.argv = {argv!r}; import os, vlmserve; {show}"
    env = {k: v for k, v in os.environ.items() if k not in KEYS} | user
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    spin, wait = out.stdout.split()
    return spin, wait


@pytest.mark.parametrize(
    "argv, user, expected",
    [
        (["/venv/bin/vlmserve", "serve", "--port", "8000"], {}, ("10000000", "None")),
        (["-m", "serve", "--model", "m"], {}, ("10000000", "None")),  # python -m vlmserve.cli
        (["/venv/bin/vlmserve", "generate"], {}, ("10000000", "None")),
        (["/venv/bin/vlmserve", "caption", "--input", "x"], {}, ("10000000", "None")),
        (["-m", "demo"], {}, ("10000000", "None")),
        (["/venv/bin/vlmserve", "estimate", "kv"], {}, ("None", "PASSIVE")),
        (["/venv/bin/vlmserve"], {}, ("None", "PASSIVE")),
        (["-c"], {}, ("None", "PASSIVE")),  # the library
        (["/venv/bin/vlmserve", "serve"], {"OMP_WAIT_POLICY": "PASSIVE"}, ("None", "PASSIVE")),
        (["/venv/bin/vlmserve", "serve"], {"GOMP_SPINCOUNT": "5"}, ("5", "None")),
        (["/venv/bin/vlmserve", "caption"], {"OMP_WAIT_POLICY": "ACTIVE"}, ("None", "ACTIVE")),
    ],
)
def test_each_command_gets_its_wait_policy(argv, user, expected):
    assert _policy(argv, **user) == expected


def _child_env(queue) -> None:
    queue.put(tuple(os.environ.get(k) for k in KEYS[:2]))


@pytest.mark.slow
def test_pool_workers_wait_passively_beside_a_spinning_server(monkeypatch):
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000000")
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv("VLMSERVE_SPIN_ENGINE_ONLY", "1")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with _workers_wait_passively():
        child = ctx.Process(target=_child_env, args=(queue,))
        child.start()
    assert queue.get(timeout=60) == (None, "PASSIVE")
    child.join(timeout=60)
    # The server's own setting is back for everything started after.
    assert os.environ["GOMP_SPINCOUNT"] == "10000000" and "OMP_WAIT_POLICY" not in os.environ

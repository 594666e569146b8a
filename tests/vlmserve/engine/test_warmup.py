"""The start-up warm-up (vlmserve/engine/warmup.py): it runs its phases, leaves the
engine idle with every block back and the same outputs, and `serve` runs it before
/health turns 200."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from benchmarks.reliability.server import free_port
from scheduler.config import CacheConfig, SchedulerConfig
from tests.helpers import chat
from vlmserve.config import EngineConfig, ModelConfig
from vlmserve.engine.core import Engine
from vlmserve.engine.warmup import decode_buckets
from vlmserve.sample.params import SamplingParams


def engine(path, warmup: bool) -> Engine:
    return Engine(
        EngineConfig(
            ModelConfig(str(path)),
            CacheConfig(num_blocks=256, block_size=16),
            SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=6),
            warmup=warmup,
            warmup_max_seconds=600,  # every phase, however loaded the machine
        )
    )


def test_decode_buckets():
    assert decode_buckets(1) == [1]
    assert decode_buckets(6) == [1, 2, 4, 6]
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 32, 64]


@pytest.mark.slow
def test_warmup_runs_every_phase_and_changes_no_output(llava_ov_path, random_image):
    warm = engine(llava_ov_path, warmup=True)
    report = warm.warmup
    assert report is not None and not report.skipped
    # First what a request's path would build on first use (the pool path: no copies).
    assert report.phases[:2] == ["shared tokenizer", "grammar tables"]
    assert warm.grammars._grammars._compiler is not None
    linears = ["linears x1-6"] if warm.runner.device.type == "cpu" else []  # decode rows
    assert report.phases[2 : len(linears) + 4] == [*linears, "sampled", "prefill 256"]
    assert [p for p in report.phases if p.startswith("decode")] == [
        "decode x1", "decode x2", "decode x4", "decode x6"
    ]  # fmt: skip
    assert sum(p.startswith("image") for p in report.phases) == 2
    assert report.num_steps == warm.num_steps > 0  # (the linears phase runs no step)
    bm = warm.scheduler.block_manager
    assert not warm.has_unfinished() and bm.num_free_blocks == bm.num_blocks
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    request = chat([random_image(1, 90, 50)], "where is the star", params)
    [after] = warm.generate([request])
    [cold] = engine(llava_ov_path, warmup=False).generate([request])
    assert after.token_ids == cold.token_ids


@pytest.mark.slow
def test_serve_answers_503_until_the_warmup_is_done(llama_path, tmp_path):
    """`vlmserve serve` on a loopback port: /health is 503 while the engine loads and
    warms up, and the warm-up's line is in the log when it first answers 200."""
    port = free_port()
    log_path = tmp_path / "serve.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.getcwd()}
    cmd = [sys.executable, "-m", "vlmserve.cli", "serve", "--model", str(llama_path),
           "--port", str(port), "--max-num-seqs", "4"]  # fmt: skip
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        statuses, deadline = [], time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                statuses.append(httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code)
                if statuses[-1] == 200:
                    break
            time.sleep(0.05)
        text = log_path.read_text(errors="replace")  # as it was when /health said 200
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert statuses and statuses[-1] == 200, text[-3000:]
    assert 503 in statuses  # loading and warming up
    assert "warm-up done in" in text and "decode x4" in text, text[-3000:]
    assert "grammar tables" in text and "token texts (logprobs) ready" in text, text[-3000:]
    assert "dtype torch.float32 (checkpoint is float32)" in text

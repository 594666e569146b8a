"""The `vlmserve` command as a user runs it: a real subprocess."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from vlmserve.cli.main import main


def vlmserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vlmserve.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_info_reports_versions_pil_device_and_backend():
    result = vlmserve("info", "--json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["torch"] and info["transformers"] and info["timm"]
    assert info["pil"]["variant"] in ("pillow", "pillow-simd")
    assert isinstance(info["pil"]["simd"], bool)
    assert info["device"] in ("cpu", "cuda")
    assert "Gemma 3" in info["model_families"] and "LLaVA-OneVision" in info["model_families"]
    from kernels.cpu_attention import available

    if info["device"] == "cpu":
        assert info["attention_backend"] == ("cpu" if available() is None else "torch")
    else:
        assert info["attention_backend"] in ("triton", "flashinfer")
    ops = info["ops"]
    assert ops["attention"] == info["attention_backend"]
    keys = {"attention", "rope", "add_rms_norm", "silu_and_mul", "gelu_tanh_and_mul", "linear",
            "cuda_graphs", "qk_norm_rope_kv_write"}  # fmt: skip
    assert set(ops) == keys
    from kernels import fused_ops, packed_linear

    if info["device"] == "cpu" and fused_ops.available() is None:
        assert ops["add_rms_norm"] == "cpu C++ (fused)" and ops["cuda_graphs"] == "off"
        if info["attention_backend"] == "cpu":
            assert ops["qk_norm_rope_kv_write"].startswith("cpu C++")
    if info["device"] == "cpu" and packed_linear.skinny_available() is None:
        assert ops["linear"].startswith("onednn packed; skinny C++")
    # the dtype --dtype auto would pick for a 16-bit checkpoint, and why
    from kernels.cpu_build import native_bf16

    if info["device"] == "cpu":
        want = "bfloat16" if native_bf16() else "float32"
        assert info["dtype"].startswith(want) and "checkpoint is bfloat16" in info["dtype"]
        # our AMX kernels exactly where the CPU has AMX tiles and they built
        from kernels.cpu_attention import amx_available
        from kernels.cpu_build import cpu_flags

        has_amx = "amx_bf16" in cpu_flags() and amx_available()
        assert info["amx"].startswith("prefill and decode attention") == has_amx, info["amx"]


def test_info_names_the_dtype_a_model_would_run_in(llama_path, capsys):
    assert main(["info", "--json", "--model", str(llama_path)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["dtype"].startswith("float32 (checkpoint is float32")  # the random ones


def test_info_prints_each_calibrated_choice_and_recalibrates(llama_path, capsys, monkeypatch,
                                                             tmp_path):  # fmt: skip
    """On a CPU, `info --model` lists every kernel choice at the model's shapes with the
    measurements behind it and the cache file; `--recalibrate` measures them anew."""
    from kernels import calibration, cpu_attention, packed_linear

    if packed_linear.skinny_available() or cpu_attention.prefill_available():
        pytest.skip("the CPU kernels did not build here")
    monkeypatch.setattr(calibration, "CACHE_DIR", tmp_path)
    monkeypatch.setattr(calibration, "_entries", {})
    monkeypatch.setattr(cpu_attention, "PREFILL_CASES", ((0, 64), (32, 32)))  # quick
    monkeypatch.setattr(packed_linear, "MKL_DIM", 64)
    assert main(["info", "--json", "--model", str(llama_path)]) == 0
    info = json.loads(capsys.readouterr().out)
    if info["device"] != "cpu":
        pytest.skip("not a CPU device")
    report = info["calibration"]
    assert report["cache"].startswith(str(tmp_path)) and Path(report["cache"]).is_file()
    assert report["key"]["torch"] and report["key"]["flags"] and report["key"]["cpu"]
    # llama random: hidden 64, 4 heads / 2 KV of 16, intermediate 128, vocab 256, float32
    names = set(report["choices"])
    assert {"linear_skinny_max_rows/float32/64x128", "linear_skinny_max_rows/float32/64x256",
            "linear_skinny_max_rows/float32/128x64", "lm_head/float32/64x256",
            "mkl_min_rows/float32/64x64", "prefill_attention/float32/4x2x16"} <= names  # fmt: skip
    head = report["choices"]["lm_head/float32/64x256"]
    assert head["choice"] == calibration.decide_head(head["measured"])._asdict()
    assert all(r["skinny"] > 0 and r["packed"] > 0 and r["plain"] > 0 for r in head["measured"])
    attention = report["choices"]["prefill_attention/float32/4x2x16"]
    assert info["attention_backend"] == ("cpu" if attention["choice"] else "cpu-sdpa")
    prefetch = report["choices"]["decode_prefetch/float32/4x2x16"]  # timed from memory
    assert prefetch["choice"] == calibration.decide_faster(prefetch["measured"], "spread", "whole")
    way = "by lines" if prefetch["choice"] else "whole"
    # the AMX path is bfloat16's alone
    assert info["decode_attention"] == f"vector, the next block prefetched {way}"
    # adaptive speculation's B* in the model's dtype: s_w·π/(2β), float32's 4 bytes
    (ridge,) = report["choices"]["ridge/float32"]["measured"]
    b_star = 4 * ridge["gemm_flops"] / (2 * ridge["copy_bytes_per_s"])
    assert report["choices"]["ridge/float32"]["choice"] == pytest.approx(b_star)
    stamp = Path(report["cache"]).stat().st_mtime_ns
    timed = []
    time_paths = calibration.time_paths
    monkeypatch.setattr(calibration, "time_paths", lambda p: timed.append(1) or time_paths(p))
    assert main(["info", "--model", str(llama_path)]) == 0  # cached: nothing measured
    text = capsys.readouterr().out
    assert not timed and "lm_head/float32/64x256" in text and report["cache"] in text
    flops = f"gemm_flops={ridge['gemm_flops'] / 1e9:.0f}G"  # rates, not milliseconds
    assert f"{flops} copy_bytes_per_s={ridge['copy_bytes_per_s'] / 1e9:.1f}G" in text
    assert main(["info", "--json", "--recalibrate", "--model", str(llama_path)]) == 0
    capsys.readouterr()
    assert len(timed) >= 6 and Path(report["cache"]).stat().st_mtime_ns > stamp


@pytest.mark.slow
def test_info_build_kernels_builds_each_cpu_kernel_ahead_of_the_engine():
    from kernels import cpu_build

    first = vlmserve("info", "--build-kernels", "--json")
    if first.returncode != 0 and "unavailable" in first.stdout:
        pytest.skip("no C++ compiler here")
    assert first.returncode == 0, first.stderr
    assert "building the C++ CPU kernels" in first.stderr  # says so while it happens
    kernels = json.loads(first.stdout)["cpu_kernels"]
    assert set(kernels) == set(cpu_build.KERNELS) and len(kernels) >= 4
    assert all(v == "already built" or v.startswith("built in") for v in kernels.values())
    # Built where an engine in this environment looks: a later process compiles nothing.
    for name in cpu_build.KERNELS:
        directory = cpu_build.build_directory(name, cpu_build.CSRC / f"{name}.cpp")
        assert any(directory.glob("*.so")), name
    second = json.loads(vlmserve("info", "--build-kernels", "--json").stdout)["cpu_kernels"]
    assert set(second.values()) == {"already built"}


def test_info_reports_how_tensor_parallelism_splits_a_model(llava_ov_path, capsys):
    # LLaVA-OV random: 2 layers, 4 heads over 2 KV heads, head_dim 16, float32 on CPU.
    # 4 ranks: one query head each, each KV head on two ranks (article §16).
    assert main(["info", "--json", "--model", str(llava_ov_path), "--tp", "4"]) == 0
    tp = json.loads(capsys.readouterr().out)["tensor_parallel"]
    assert (tp["heads_per_rank"], tp["kv_heads_per_rank"], tp["kv_replicas"]) == (1, 1, 2)
    assert tp["kv_bytes_per_token_per_rank"] == 2 * 2 * 1 * 16 * 4


@pytest.fixture(scope="module")
def jpeg(tmp_path_factory, random_image):
    path = tmp_path_factory.mktemp("img") / "scene.jpg"
    random_image(5, 80, 48).save(path, quality=90)
    return path


@pytest.mark.slow
def test_generate_answers_about_an_image_file(llava_ov_path, jpeg):
    result = vlmserve("generate", "--model", str(llava_ov_path), "--image", str(jpeg),
                      "--prompt", "where is the star", "--max-tokens", "5")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.split()) >= 1
    assert "prompt tokens" in result.stderr and "5 output" in result.stderr


@pytest.mark.slow
def test_generate_n_answers_with_logprobs(llava_ov_path, jpeg):
    """--n 2 --seed: two answers, each with one logprob line per token (the top 3 after)."""
    result = vlmserve("generate", "--model", str(llava_ov_path), "--image", str(jpeg),
                      "--prompt", "where is the star", "--max-tokens", "4", "--n", "2",
                      "--seed", "3", "--temperature", "1", "--logprobs", "3")  # fmt: skip
    assert result.returncode == 0, result.stderr
    answers = result.stdout.splitlines()
    assert [a[:4] for a in answers] == ["[0] ", "[1] "]
    lines = [line for line in result.stderr.splitlines() if line.startswith("  '")]
    assert len(lines) == 8 and all(line.count("=") == 3 for line in lines)


@pytest.mark.slow
def test_generate_with_a_corrupt_image_is_a_message_not_a_traceback(llava_ov_path, tmp_path):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    result = vlmserve("generate", "--model", str(llava_ov_path), "--image", str(bad),
                      "--prompt", "describe")  # fmt: skip
    assert result.returncode == 2
    assert "cannot decode image" in result.stderr
    assert "Traceback" not in result.stderr


# -- the shared engine flags, through each door ------------------------------------------

# Always draft (no ridge or acceptance gating), from 1-grams up: the most drafts, so the
# tests see speculation happen whatever this machine's measured ridge.
ALWAYS_SPECULATE = ["--speculative-tokens", "4", "--no-adaptive-speculation",
                    "--speculative-ngram-min", "1"]  # fmt: skip


def num_drafted(text: str) -> int:
    """Drafted tokens from the `[engine: ...]` line a door prints at the end."""
    match = re.search(r"speculation (\d+) drafted, (\d+) accepted", text)
    assert match, text
    return int(match.group(1))


@pytest.fixture(scope="module")
def scene_png(tmp_path_factory) -> Path:
    """A held-out scene for the embedded default model (the model of every door)."""
    from vlmserve.embedded.evaluate import heldout_scenes
    from vlmserve.embedded.scenes import render_scene

    path = tmp_path_factory.mktemp("scene") / "scene.png"
    render_scene(heldout_scenes(3)[2]).save(path)
    return path


@pytest.mark.slow
def test_generate_speculates_and_answers_as_without(scene_png, capsys):
    args = ["generate", "--image", str(scene_png), "--prompt", "Describe the image.",
            "--max-tokens", "40"]  # fmt: skip
    assert main([*args, "--speculative-tokens", "0"]) == 0
    plain = capsys.readouterr()
    assert main(args) == 0  # the default: adaptive γ up to 4
    adaptive = capsys.readouterr()
    assert main([*args, *ALWAYS_SPECULATE]) == 0
    always = capsys.readouterr()
    assert plain.out.strip() and plain.out == adaptive.out == always.out  # greedy: lossless
    assert "speculation off" in plain.err
    # The default model's image takes the pool and the encoder cache, like any model's.
    assert re.search(r"preprocess pool [1-9]\d* workers, [1-9]\d* images", plain.err)
    assert "encoder cache 0 hits, 1 misses" in plain.err
    assert num_drafted(adaptive.err) >= 0  # on; how much it drafts depends on the ridge
    assert num_drafted(always.err) > 0


@pytest.mark.slow
def test_generate_with_async_scheduling_answers_as_without(scene_png, capsys):
    args = ["generate", "--image", str(scene_png), "--prompt", "Describe the image.",
            "--max-tokens", "40"]  # fmt: skip
    assert main(args) == 0
    plain = capsys.readouterr()
    assert main([*args, "--async-scheduling"]) == 0
    overlapped = capsys.readouterr()
    assert plain.out.strip() and overlapped.out == plain.out


def test_generate_with_slo_targets_answers_as_without(scene_png, capsys):
    # The targets change which request runs when (slack order, TPOT-guarded lump chunks),
    # never what a request computes: greedy output is the same.
    args = ["generate", "--image", str(scene_png), "--prompt", "Describe the image.",
            "--max-tokens", "40"]  # fmt: skip
    assert main(args) == 0
    plain = capsys.readouterr()
    assert main([*args, "--slo-ttft-ms", "text=300,image=900", "--slo-tpot-ms", "50"]) == 0
    planned = capsys.readouterr()
    assert plain.out.strip() and planned.out == plain.out


@pytest.mark.slow
def test_demo_speculates_and_answers_as_without(capsys):
    def answers(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.strip().startswith("A:")]

    assert main(["demo", "--speculative-tokens", "0"]) == 0
    plain = capsys.readouterr().out
    assert main(["demo", *ALWAYS_SPECULATE]) == 0
    spec = capsys.readouterr().out
    assert len(answers(plain)) == 8 and answers(spec) == answers(plain)
    assert "speculation off" in plain and num_drafted(spec) > 0
    # Three scene files through the pool; the questions about one of them after the
    # captions find its embeddings in the encoder cache.
    assert re.search(r"preprocess pool [1-9]\d* workers, [1-9]\d* images", plain)
    assert re.search(r"encoder cache 5 hits, 3 misses, [1-9]\d* KiB held", plain)


@pytest.mark.slow
def test_preprocess_and_encoder_cache_flags_reach_the_engine(llava_ov_path, jpeg, capsys):
    args = ["generate", "--model", str(llava_ov_path), "--image", str(jpeg), "--prompt",
            "where is the star", "--max-tokens", "3"]  # fmt: skip
    assert main([*args, "--preprocess-workers", "1"]) == 0
    pooled = capsys.readouterr()
    assert "preprocess pool 1 workers, 1 images" in pooled.err
    assert re.search(r"encoder cache 0 hits, 1 misses, [1-9]\d* KiB held", pooled.err)
    assert main([*args, "--preprocess-workers", "0", "--encoder-cache-mb", "0"]) == 0
    inline = capsys.readouterr()
    assert "preprocess pool" not in inline.err  # decoded inline: no pool
    assert "encoder cache 0 hits, 1 misses, 0 KiB held" in inline.err
    assert inline.out == pooled.out


@contextlib.contextmanager
def serve_subprocess(*flags: str) -> Iterator[str]:
    """`vlmserve serve --port 0 ...` as a user starts it; yields its base URL once /health
    answers 200."""
    env = {k: v for k, v in os.environ.items() if k != "VLMSERVE_API_KEY"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "vlmserve.cli", "serve", "--port", "0", *flags],
        stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        url = None
        for line in proc.stderr:  # uvicorn names the port it bound
            if match := re.search(r"Uvicorn running on (http://\S+)", line):
                url = match.group(1)
                break
        assert url, "the server did not start"
        threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep the pipe drained
        deadline = time.monotonic() + 120
        while httpx.get(url + "/health").status_code != 200:
            assert time.monotonic() < deadline and proc.poll() is None, "the engine did not load"
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def needs_server_libraries() -> None:
    """`serve` needs the server's libraries; a GPU machine's own environment may lack them."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")


@pytest.mark.slow
def test_serve_speculates_and_answers_as_generate(scene_png, capsys):
    needs_server_libraries()
    assert main(["generate", "--image", str(scene_png), "--prompt", "Describe the image.",
                 "--max-tokens", "40"]) == 0  # fmt: skip
    offline = capsys.readouterr().out.strip()
    image = "data:image/png;base64," + base64.b64encode(scene_png.read_bytes()).decode()
    body = {
        "model": "default_model",
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": image}},
            {"type": "text", "text": "Describe the image."}]}],
        "max_tokens": 40,
        "temperature": 0,
    }  # fmt: skip
    with serve_subprocess(*ALWAYS_SPECULATE) as url:
        response = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        metrics = httpx.get(url + "/metrics").text
    assert response.json()["choices"][0]["message"]["content"].strip() == offline
    assert metric(metrics, "vlmserve_spec_proposed_total") > 0
    # The KV pool is sized to what 64 sequences of the model's 512 tokens fill, not 1 GiB.
    assert metric(metrics, "vlmserve_num_kv_blocks") == 64 * 512 / 16


@pytest.mark.slow
def test_serve_exits_non_zero_when_its_engine_dies(tmp_path):
    """A checkpoint whose weights are cut short: the engine fails to load on the engine
    thread, and the server stops and exits 1 instead of keeping a port open."""
    needs_server_libraries()
    from vlmserve.embedded import DEFAULT_MODEL_DIR

    broken = tmp_path / "broken_model"
    shutil.copytree(DEFAULT_MODEL_DIR, broken)
    weights = next(broken.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:1000])
    result = subprocess.run(
        [sys.executable, "-m", "vlmserve.cli", "serve", "--port", "0", "--model", str(broken)],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-2000:]
    assert "error: the engine failed" in result.stderr

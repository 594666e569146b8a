"""The `vlmserve` command as a user runs it: a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def vlmserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vlmserve.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_info_reports_versions_pil_device_and_backend():
    result = vlmserve("info", "--json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["torch"] and info["transformers"] and info["timm"]
    assert info["pil"]["variant"] in ("pillow", "pillow-simd")
    assert isinstance(info["pil"]["simd"], bool)
    assert info["device"] in ("cpu", "cuda")
    assert info["attention_backend"] == "torch"


@pytest.fixture(scope="module")
def jpeg(tmp_path_factory, random_image):
    path = tmp_path_factory.mktemp("img") / "scene.jpg"
    random_image(5, 80, 48).save(path, quality=90)
    return path


def test_generate_answers_about_an_image_file(llava_ov_path, jpeg):
    result = vlmserve("generate", "--model", str(llava_ov_path), "--image", str(jpeg),
                      "--prompt", "where is the star", "--max-tokens", "5")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.split()) >= 1
    assert "prompt tokens" in result.stderr and "5 output" in result.stderr


def test_generate_with_a_corrupt_image_is_a_message_not_a_traceback(llava_ov_path, tmp_path):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    result = vlmserve("generate", "--model", str(llava_ov_path), "--image", str(bad),
                      "--prompt", "describe")  # fmt: skip
    assert result.returncode == 2
    assert "cannot decode image" in result.stderr
    assert "Traceback" not in result.stderr

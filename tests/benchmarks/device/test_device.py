"""The GPU device run's preparation (benchmarks/device/): the bundle's checks on made-up
wheels, the gpu tests' collection where the server libraries, pulp and FlashInfer are
missing (as on the device before its bundle), and run.sh on a machine without CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from benchmarks.device.bundle_check import check, read_pins, read_wheel
from kernels import cpu_build

REPO = Path(__file__).resolve().parents[3]
# What the device lacks until its bundle is installed (and what it never gets).
MISSING = ("fastapi", "uvicorn", "starlette", "pydantic", "pulp", "openai", "ray", "flashinfer",
           "xgrammar")  # fmt: skip


def make_wheel(folder: Path, name: str, version: str, requires: list[str], tag: str) -> Path:
    path = folder / f"{name}-{version}-{tag}.whl"
    meta = "\n".join(["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
                      *(f"Requires-Dist: {r}" for r in requires)])  # fmt: skip
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", meta + "\n")
    return path


def test_bundle_check_names_each_gap(tmp_path):
    pure, cp312 = "py3-none-any", "cp312-cp312-manylinux_2_17_x86_64"
    wheels = [
        make_wheel(tmp_path, "server", "1.0", ["anyio>=4", "core==2.0", "gone", "torch>=2.12",
                                               "win; sys_platform == 'win32'", "x; extra == 'a'"],
                   pure),
        make_wheel(tmp_path, "core", "2.0", [], cp312),
        make_wheel(tmp_path, "old", "1.0", [], "cp311-cp311-manylinux_2_17_x86_64"),
        make_wheel(tmp_path, "new_glibc", "1.0", [], "cp312-cp312-manylinux_2_40_x86_64"),
        make_wheel(tmp_path, "flashinfer_python", "0.6.9", ["nvidia-cutlass-dsl>=4"], pure),
    ]  # fmt: skip
    pins = read_pins(write(tmp_path / "pins.txt", "server==1.0  # why\ncore==2.0\nmissing==3\n"))
    device = read_pins(write(tmp_path / "device.txt", "# the device\nanyio\ntorch==2.11.0\n"))
    problems = check([read_wheel(w) for w in wheels], pins, device)
    assert sorted(problems) == sorted([
        "missing==3 (bundle.txt) is not in the bundle",
        "server needs gone: neither in the bundle nor on the device",
        "server needs torch>=2.12; the device has 2.11.0",
        "old-1.0-cp311-cp311-manylinux_2_17_x86_64.whl: no tag the device's CPython 3.12 "
        "x86_64 installs",
        "new_glibc-1.0-cp312-cp312-manylinux_2_40_x86_64.whl: no tag the device's CPython 3.12 "
        "x86_64 installs",
    ])  # fmt: skip
    # Two versions of one package stop the device's whole install.
    second = make_wheel(tmp_path, "core", "2.1", [], cp312)
    problems = check([read_wheel(w) for w in [*wheels, second]], pins, device)
    assert "core: two versions (2.0, 2.1)" in problems
    assert "server needs core==2.0; the bundle has 2.1" in problems


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_the_real_bundle_list_pins_every_line_and_the_device_list_reads():
    pins = read_pins(REPO / "benchmarks/device/bundle.txt")
    assert "flashinfer-python" in pins and "pulp" in pins and "fastapi" in pins
    assert all(version is not None for version in pins.values())
    device = read_pins(REPO / "benchmarks/device/device_packages.txt")
    assert str(device["torch"]) == "2.11.0" and str(device["transformers"]) == "5.17.0"
    assert not set(pins) & set(device) - {"typing-extensions", "anyio"}  # carried anyway


def blocking_env(tmp_path: Path) -> dict[str, str]:
    """An environment in whose Python processes MISSING cannot be imported (a
    sitecustomize, so subprocesses inherit it), and C++ builds land in an empty folder."""
    site = tmp_path / "block"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import sys

        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {MISSING!r}:
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)

        sys.meta_path.insert(0, Block())
    """))  # fmt: skip
    path = os.pathsep.join([str(site), str(REPO), os.environ.get("PYTHONPATH", "")])
    builds = tmp_path / "torch_extensions"
    builds.mkdir()
    return {**os.environ, "PYTHONPATH": path, "TORCH_EXTENSIONS_DIR": str(builds)}


@pytest.mark.slow
def test_gpu_tests_collect_without_the_server_libraries_pulp_or_flashinfer(tmp_path):
    """What `pytest -m gpu` does first on the device: no collection error, and no C++ kernel
    built at collection (that is device time, and a build killed midway hangs the next)."""
    env = blocking_env(tmp_path)
    probe = subprocess.run([sys.executable, "-c", "import fastapi"], env=env, capture_output=True)
    assert probe.returncode != 0  # the blocking works
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "--collect-only", "tests",
         "-p", "no:cacheprovider"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " error" not in result.stdout.splitlines()[-1]
    assert not any(Path(env["TORCH_EXTENSIONS_DIR"]).iterdir())


@pytest.mark.slow
def test_run_sh_without_cuda_checks_imports_and_collection_then_says_so(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "VLMSERVE_BUNDLE": str(tmp_path / "none"),
           "PYTHONPATH": str(REPO)}  # fmt: skip
    result = subprocess.run(
        ["bash", "benchmarks/device/run.sh", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    log = (out / "env.log").read_text()
    assert result.returncode == 2, log[-3000:]
    assert "0 failed" in log and "collection exit 0" in log
    # the C++ CPU kernels built (or found built) before any part, each of them
    built = log.split("=== the C++ CPU kernels ===")[1].split("run.sh: kernels built")[0]
    assert all(f"'{name}'" in built for name in cpu_build.KERNELS), built
    assert "unavailable" not in built, built
    assert log.rstrip().endswith("the GPU parts need an NVIDIA GPU")
    assert "no CUDA device visible" in log.splitlines()[-1]


def test_summary_names_the_parts_cut_off_and_leaves_out_those_not_run(tmp_path):
    """A part that started and never saved its result failed; one not run is no failure."""
    from benchmarks import gpu_check

    def save(name, body):
        (tmp_path / f"{name}.json").write_text(json.dumps(body))

    save("tests", {"result": 0, "failed": False, "seconds": 40})
    save("bf16", {"result": 0, "failed": False, "seconds": 20})
    save("offline", {"result": None, "failed": True, "unfinished": True})
    results, failures = gpu_check.saved_results(tmp_path)
    assert failures == ["offline (no result: see its log)"]
    assert set(results) == {"tests", "bf16"}
    lines = gpu_check.summary(results, failures, "a GPU")
    assert "gpu tests            passed" in lines
    assert lines[-1] == "failed parts         offline (no result: see its log)"
    assert gpu_check._exit(results, failures, results["tests"]) == 1
    (tmp_path / "offline.json").unlink()
    assert gpu_check._exit(*gpu_check.saved_results(tmp_path), 0) == 0

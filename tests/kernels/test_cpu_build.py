"""The C++ kernels' build directory is keyed by everything that enters its build file."""

from __future__ import annotations

import shlex
import sysconfig

import pytest
from torch.utils import cpp_extension

from kernels import cpu_build

SOURCE = cpu_build.CSRC / "fused_ops_cpu.cpp"


def _more_includes(monkeypatch):
    include_paths = cpp_extension.include_paths
    monkeypatch.setattr(
        cpp_extension, "include_paths", lambda *a, **k: [*include_paths(*a, **k), "/other/include"]
    )


def _torch_elsewhere(monkeypatch):
    # The same torch installed at another path (a second virtualenv, a symlinked one).
    include_paths, library_paths = cpp_extension.include_paths, cpp_extension.library_paths
    monkeypatch.setattr(
        cpp_extension,
        "include_paths",
        lambda *a, **k: [p.replace("/site-packages/", "/venv2/") for p in include_paths(*a, **k)],
    )
    monkeypatch.setattr(
        cpp_extension,
        "library_paths",
        lambda *a, **k: [p.replace("/site-packages/", "/venv2/") for p in library_paths(*a, **k)],
    )


def _other_python(monkeypatch):
    get_path = sysconfig.get_path
    monkeypatch.setattr(
        sysconfig, "get_path", lambda name, *a, **k: "/py2/include" if name == "include" else None
    )
    assert get_path("include")


def _other_compiler(monkeypatch):
    monkeypatch.setenv("CXX", "clang++")


def _other_flags(monkeypatch):
    monkeypatch.setattr(cpu_build, "CFLAGS", (*cpu_build.CFLAGS, "-DNDEBUG"))


@pytest.mark.parametrize(
    "change", [_more_includes, _torch_elsewhere, _other_python, _other_compiler, _other_flags]
)
def test_the_build_key_changes_with_each_input_of_the_build_file(monkeypatch, change):
    key = cpu_build.build_key(SOURCE)
    assert cpu_build.build_key(SOURCE) == key  # stable while nothing changes
    change(monkeypatch)
    assert cpu_build.build_key(SOURCE) != key


def test_the_key_names_every_path_and_flag_torch_writes_into_the_build_file():
    # The reference: the build.ninja torch itself wrote for a kernel built with these inputs.
    key = cpu_build.build_key(SOURCE)
    if cpu_build.load("fused_ops_cpu") is not None:
        pytest.skip("no C++ compiler here")
    assert cpu_build.build_key(SOURCE) == key  # loading (torch's build) changes no input
    ninja = (cpu_build.build_directory("fused_ops_cpu", SOURCE) / "build.ninja").read_text()
    lines = dict(line.split(" = ", 1) for line in ninja.splitlines() if " = " in line)
    inputs = cpu_build.build_inputs()
    cflags = shlex.split(lines["cflags"])
    includes = {cflags[i + 1] for i, flag in enumerate(cflags) if flag == "-isystem"}
    assert includes == {item.removeprefix("include=") for item in inputs if "include=" in item}
    libs = {flag[2:] for flag in shlex.split(lines["ldflags"]) if flag.startswith("-L")}
    assert libs == {item.removeprefix("lib=") for item in inputs if item.startswith("lib=")}
    assert f"cxx={lines['cxx']}" in inputs
    assert all(flag in cflags for flag in cpu_build.cflags())

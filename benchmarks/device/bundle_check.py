"""Checks the device bundle before it travels: every wheel installs on the device (cp312,
manylinux x86_64), one version of each, each pin of bundle.txt there, every need of every
wheel met by another wheel or by the device's own packages, and the bundle plus the
working tree under the device call's 64 MiB carry limit.

    python -m benchmarks.device.bundle_check .device-bundle
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

HERE = Path(__file__).resolve().parent
CARRY_LIMIT_BYTES = 64 << 20  # the working tree and the carried paths together
MAX_GLIBC = (2, 39)  # the device's image: Python 3.12.3 on Ubuntu 24.04
# The device's interpreter, for requirement markers ("extra" empty: no extras installed).
DEVICE_MARKERS = {
    "python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
    "platform_python_implementation": "CPython", "sys_platform": "linux", "os_name": "posix",
    "platform_system": "Linux", "platform_machine": "x86_64", "extra": "",
}  # fmt: skip
# Needs of flashinfer-python that the attention backend's path (the FA2/FA3 decode and
# prefill wrappers, JIT-built with nvcc) never imports; carrying them would not fit.
NOT_CARRIED = {
    "nvidia-cutlass-dsl": "CuTe-DSL kernels only (the wheels with their libs: over 100 MB)",
    "nvidia-cudnn-frontend": "the cuDNN attention backend only (12 MB)",
    "cuda-tile": "cuTile kernels only",
    "nccl4py": "FlashInfer's communication ops only",
    "cuda-python": "a meta package over cuda-bindings, which the device has",
}


@dataclass(frozen=True)
class Wheel:
    path: Path
    name: str  # canonical
    version: Version
    requires: tuple[Requirement, ...]  # those whose markers hold on the device


def read_wheel(path: Path) -> Wheel:
    name, version, _, _ = parse_wheel_filename(path.name)
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        headers = Parser().parsestr(z.read(meta).decode())
    needs = [Requirement(r) for r in headers.get_all("Requires-Dist") or []]
    needs = [r for r in needs if r.marker is None or r.marker.evaluate(DEVICE_MARKERS)]
    return Wheel(path, canonicalize_name(name), version, tuple(needs))


def installs_on_device(path: Path) -> bool:
    """A tag of the wheel's that the device's pip takes: pure Python, or CPython 3.12 on
    manylinux x86_64 no newer than its glibc."""
    _, _, _, tags = parse_wheel_filename(path.name)
    for tag in tags:
        if tag.interpreter not in ("py3", "py312", "cp312") or tag.abi not in (
            "none",
            "abi3",
            "cp312",
        ):
            continue
        if tag.platform == "any" or tag.platform in ("manylinux1_x86_64", "manylinux2014_x86_64"):
            return True
        if m := re.fullmatch(r"manylinux_(\d+)_(\d+)_x86_64", tag.platform):
            if (int(m[1]), int(m[2])) <= MAX_GLIBC:
                return True
    return False


def read_pins(path: Path) -> dict[str, Version]:
    """name -> version of each `name==version` line (comments and blanks skipped)."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = Version(version) if version else None
    return pins


def check(wheels: list[Wheel], pins: dict, device: dict) -> list[str]:
    """What is wrong with the bundle (empty: nothing)."""
    problems = []
    by_name: dict[str, Wheel] = {}
    for w in wheels:
        if w.name in by_name:
            problems.append(f"{w.name}: two versions ({by_name[w.name].version}, {w.version})")
        by_name[w.name] = w
        if not installs_on_device(w.path):
            problems.append(f"{w.path.name}: no tag the device's CPython 3.12 x86_64 installs")
    for name, version in pins.items():
        if name not in by_name or by_name[name].version != version:
            problems.append(f"{name}=={version} (bundle.txt) is not in the bundle")
    for w in wheels:
        for need in w.requires:
            name = canonicalize_name(need.name)
            if name in by_name:
                if not need.specifier.contains(by_name[name].version, prereleases=True):
                    problems.append(
                        f"{w.name} needs {need}; the bundle has {by_name[name].version}"
                    )
            elif name in device:
                known = device[name]
                if known is not None and not need.specifier.contains(known, prereleases=True):
                    problems.append(f"{w.name} needs {need}; the device has {known}")
            elif name not in NOT_CARRIED:
                problems.append(f"{w.name} needs {need}: neither in the bundle nor on the device")
    return problems


def travelling_bytes(repo: Path) -> int:
    """The working tree that a device call sends: tracked and untracked-not-ignored files."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=repo, capture_output=True, check=True,
    ).stdout  # fmt: skip
    files = (repo / f for f in out.decode().split("\0") if f)
    return sum(f.lstat().st_size for f in files if f.is_symlink() or f.is_file())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundle", type=Path)
    p.add_argument("--repo", type=Path, default=HERE.parents[1])
    args = p.parse_args(argv)
    wheels = sorted((read_wheel(f) for f in args.bundle.glob("*.whl")), key=lambda w: w.name)
    device = read_pins(HERE / "device_packages.txt")
    problems = check(wheels, read_pins(HERE / "bundle.txt"), device)
    bundle_bytes = sum(w.path.stat().st_size for w in wheels)
    tree_bytes = travelling_bytes(args.repo)
    for w in wheels:
        print(f"{w.path.stat().st_size / 2**20:7.2f} MiB  {w.path.name}")
    total = bundle_bytes + tree_bytes
    print(f"bundle {bundle_bytes / 2**20:.1f} MiB ({len(wheels)} wheels) + working tree "
          f"{tree_bytes / 2**20:.1f} MiB = {total / 2**20:.1f} MiB of the "
          f"{CARRY_LIMIT_BYTES >> 20} MiB a device call carries")  # fmt: skip
    if total > CARRY_LIMIT_BYTES:
        problems.append(f"over the carry limit by {(total - CARRY_LIMIT_BYTES) / 2**20:.1f} MiB")
    for name, why in NOT_CARRIED.items():
        print(f"not carried: {name} ({why})")
    for problem in problems:
        print(f"PROBLEM: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

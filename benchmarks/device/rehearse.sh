#!/usr/bin/env bash
# Rehearses the GPU device's run on a machine without a GPU, against the device's own
# environment: a Python 3.12 virtualenv with its versions (device_packages.txt: torch
# 2.11.0+cu130, transformers 5.17.0, triton 3.6.0, ...; whatever pip pulls in that the
# device lacks is removed again), then, with no network (a fresh network namespace where
# `unshare` allows one; pip --no-index regardless):
#   1. bash benchmarks/device/run.sh: the bundle installed, preflight, the gpu collection;
#      it must stop at "no CUDA device" (exit 2), after 0 import and 0 collection errors;
#   2. CPU tests in that environment: the engine token-exact against transformers 5.17,
#      the Triton kernels in triton 3.6's interpreter, FlashInfer's API, the MILP on CBC.
# The environment is kept under VLMSERVE_REHEARSAL_DIR (default ~/.cache/vlmserve-
# rehearsal, about 5 GB: torch's CUDA wheels) and rebuilt when the device's list changes.
#
#   bash benchmarks/device/rehearse.sh          # exit 0: the rehearsal passed
set -euo pipefail
cd "$(dirname "$0")/../.."
CACHE="${VLMSERVE_REHEARSAL_DIR:-$HOME/.cache/vlmserve-rehearsal}"
VENV="$CACHE/venv312"
BUNDLE="${VLMSERVE_BUNDLE:-.device-bundle}"
# What the project needs of the device's packages (device_packages.txt gives the versions
# it knows; the others are the device's by name, any version).
NEEDED=(torch torchvision triton transformers tokenizers safetensors huggingface-hub numpy
        timm pillow pytest httpx prometheus-client matplotlib tqdm requests einops ninja
        click tabulate packaging nvidia-ml-py psutil pyyaml)

find_python312() {
    local candidate
    for candidate in python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
        if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
            command -v "$candidate"
            return
        fi
    done
    echo "rehearse.sh: no Python 3.12 here (the device runs 3.12.3): install one" \
        "(apt-get install python3.12-venv, or pyenv install 3.12) and run again" >&2
    exit 1
}

build_env() {
    local pins=() name line stamp
    for name in "${NEEDED[@]}"; do
        line="$(grep -iE "^${name}(==|$)" benchmarks/device/device_packages.txt || true)"
        pins+=("${line:-$name}")
    done
    stamp="$(printf '%s\n' "${pins[@]}" | sha256sum | cut -c1-16)"
    if [ -f "$VENV/.stamp" ] && [ "$(cat "$VENV/.stamp")" = "$stamp" ]; then
        return
    fi
    echo "rehearse.sh: building $VENV (${pins[*]})"
    [ -x "$VENV/bin/python" ] || "$(find_python312)" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q "${pins[@]}"
    # Leave nothing the device lacks: a package pip pulled in beyond its list goes again.
    local extra
    mapfile -t extra < <("$VENV/bin/python" - <<'EOF'
import importlib.metadata as md, re
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
lines = [l.strip() for l in open("benchmarks/device/device_packages.txt")]
device = {norm(l.split("==")[0]) for l in lines if l and not l.startswith("#")}
for d in md.distributions():
    if norm(d.metadata["Name"]) not in device | {"pip"}:
        print(d.metadata["Name"])
EOF
    )
    if ((${#extra[@]})); then
        echo "rehearse.sh: removing what the device does not have: ${extra[*]}"
        "$VENV/bin/python" -m pip uninstall -q -y "${extra[@]}"
    fi
    echo "$stamp" > "$VENV/.stamp"
}

offline() {
    # No network: a new network namespace (root, or unprivileged namespaces) has none.
    if unshare --net --map-root-user true 2>/dev/null; then
        unshare --net --map-root-user "$@"
    else
        echo "rehearse.sh: no network namespace here: running with the network (pip is --no-index)"
        "$@"
    fi
}

build_env
compgen -G "$BUNDLE/*.whl" >/dev/null || bash benchmarks/device/bundle.sh "$BUNDLE"
SITE="$CACHE/site"
rm -rf "$SITE"
# The C++ CPU kernels' builds for this torch, apart from other checkouts' (a build killed
# midway leaves torch's lock file behind, and the next build waits on it for ever).
export TORCH_EXTENSIONS_DIR="$CACHE/torch_extensions"
find "$TORCH_EXTENSIONS_DIR" -name lock -delete 2>/dev/null || true
OUTDIR="$CACHE/out"
rm -rf "$OUTDIR"
set +e
offline env PYTHON="$VENV/bin/python" VLMSERVE_BUNDLE="$BUNDLE" VLMSERVE_SITE="$SITE" \
    bash benchmarks/device/run.sh "$OUTDIR"
run_status=$?
echo "=== rehearse.sh: CPU tests with the device's versions ==="
offline env PYTHONPATH="$PWD:$SITE" "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
    tests/vlmserve/engine/test_engine.py::test_greedy_matches_transformers \
    tests/vlmserve/engine/test_engine.py::test_text_only_llama_gqa_matches_transformers \
    tests/kernels/test_flashinfer.py tests/kernels/test_triton.py \
    tests/search/nanoflow/test_nanoflow_milp.py::test_stage1_finds_the_hand_computed_split
tests_status=$?
set -e
echo "rehearse.sh: run.sh exit $run_status (2 expected: no CUDA device), tests exit $tests_status"
echo "rehearse.sh: logs in $OUTDIR"
[ "$run_status" -eq 2 ] && [ "$tests_status" -eq 0 ]

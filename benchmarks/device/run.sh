#!/usr/bin/env bash
# The one command for a machine with an NVIDIA GPU (the lent device, or one's own):
#   1. installs .device-bundle/ (bundle.sh), if there, with pip --no-index into a folder of
#      its own put on PYTHONPATH (nothing of the machine's own Python is changed);
#   2. preflight: the versions it runs with, every module the GPU check touches imported,
#      FlashInfer's API and pulp's CBC checked; then `pytest -m gpu --collect-only`;
#   3. without a CUDA device it stops there (exit 2, "no CUDA device");
#   4. benchmarks/gpu_check.py part by part, the short checks first (the gpu tests but
#      FlashInfer's, bf16 against transformers, the quantized GEMMs' timings: their log
#      appended to kernels.log, offline throughput in bf16, nano-batching, the kernels
#      table, FlashInfer's tests, whose kernels compile with nvcc on first use: their log
#      appended to tests.log), each in its own process under its own timeout: a part that
#      fails or runs out of time leaves the others their turn (the first lent run,
#      2026-12-04, ran out before quant in the old order). VLMSERVE_PARTS="tests bf16 ..."
#      runs those parts only, in that order;
#   5. the summary table.
# Everything it prints goes to OUT too: env.log, one log per part, summary.txt,
# results.json (8 files: a device call brings back 8 at most). It ends inside
# VLMSERVE_GPU_BUDGET_S (default 555) seconds.
#
#   bash benchmarks/device/run.sh [OUT]     # OUT: $1, else $OUT, else benchmarks/results/device
#
# Exit: 0 all passed; 1 a part or a check failed; 2 no CUDA device (checks passed).
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO="$PWD"
PY="${PYTHON:-python3}"
DEST="${1:-${OUT:-benchmarks/results/device}}"
BUNDLE="${VLMSERVE_BUNDLE:-.device-bundle}"
SITE="${VLMSERVE_SITE:-/tmp/vlmserve-site}"
BUDGET_S="${VLMSERVE_GPU_BUDGET_S:-555}"
# Seconds per part, at most; the budget left cuts the later ones shorter.
declare -A LIMIT=([tests]=150 [bf16]=80 [offline]=110 [kernels]=100 [nanobatch]=80 [quant]=30
                  [flashinfer]=150)
# A part without a log of its own writes into another's (8 files come back from a device).
declare -A LOG=([quant]=kernels [flashinfer]=tests)
for kv in ${VLMSERVE_PART_TIMEOUTS:-}; do LIMIT[${kv%%=*}]="${kv#*=}"; done  # "tests=200 ..."
mkdir -p "$DEST"
SCRATCH="$(mktemp -d)"
trap 'rm -rf "$SCRATCH"' EXIT
export PYTHONUNBUFFERED=1
START=$SECONDS

# Where the bundle goes on the path, and nvcc's CUDA_HOME (FlashInfer builds its kernels
# on first use with nvcc and ninja, under CUDA_HOME).
REQUIRE=()
if compgen -G "$BUNDLE/*.whl" >/dev/null; then
    export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"
    REQUIRE=(--require flashinfer --require pulp --require fastapi --require uvicorn)
else
    export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ -z "${CUDA_HOME:-}" ]; then  # the toolkit's root: bin/nvcc and include/ (not a wrapper's)
    nvcc_path="$(readlink -f "$(command -v nvcc || echo /none/bin/nvcc)")"
    for root in /usr/local/cuda "$(dirname "$(dirname "$nvcc_path")")"; do
        if [ -x "$root/bin/nvcc" ] && [ -f "$root/include/cuda_runtime.h" ]; then
            export CUDA_HOME="$root"
            break
        fi
    done
fi

{
    echo "run.sh: $(date -u +%FT%TZ) on $(hostname), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    if ((${#REQUIRE[@]})); then
        echo "run.sh: installing $(ls "$BUNDLE"/*.whl | wc -l) wheels from $BUNDLE into $SITE"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" "$BUNDLE"/*.whl || { echo "run.sh: the bundle did not install"; exit 1; }
    else
        echo "run.sh: no bundle at $BUNDLE: the machine's own packages (pip install -e '.[gpu]')"
    fi
    echo "CUDA_HOME      ${CUDA_HOME:-unset}"
    timeout -k 10 240 "$PY" -m benchmarks.device.preflight "${REQUIRE[@]}"
    preflight=$?
    echo "=== pytest -m gpu --collect-only ==="
    timeout -k 10 180 "$PY" -m pytest -q -m gpu --collect-only tests -p no:cacheprovider
    collected=$?
    echo "run.sh: preflight exit $preflight, collection exit $collected ($((SECONDS - START))s)"
    [ "$preflight" -eq 0 ] && [ "$collected" -eq 0 ] || exit 1
    # The C++ CPU kernels, compiled side by side before any part (the CPU engines the parts
    # compare against need them: compiled one by one at first use, they ate the first
    # lent run's budget).
    echo "=== the C++ CPU kernels ==="
    timeout -k 10 240 "$PY" -m vlmserve.cli info --build-kernels --json \
        | "$PY" -c "import json, sys; print(json.load(sys.stdin)['cpu_kernels'])"
    echo "run.sh: kernels built ($((SECONDS - START))s)"
    if ! "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
        echo "run.sh: no CUDA device visible: imports and the gpu tests' collection are checked" \
            "(0 errors); the GPU parts need an NVIDIA GPU"
        exit 2
    fi
} 2>&1 | tee "$DEST/env.log"
status=${PIPESTATUS[0]}
[ "$status" -eq 0 ] || exit "$status"

run_part() {
    local name=$1 limit=${LIMIT[$1]} left log="$DEST/${LOG[$1]:-$1}.log" append=()
    [ -n "${LOG[$1]:-}" ] && append=(-a)
    left=$((BUDGET_S - (SECONDS - START) - 20))  # 20 s kept for the summary
    ((limit > left)) && limit=$left
    if ((limit < 20)); then
        echo "run.sh: no time left for $name" | tee "${append[@]}" "$log"
        return
    fi
    echo "=== $name: at most ${limit}s ($((SECONDS - START))s in) ===" | tee "${append[@]}" "$log"
    local t0=$SECONDS
    timeout -k 10 "$limit" "$PY" -m benchmarks.gpu_check --part "$name" --save "$SCRATCH" \
        --tests-timeout-s $((limit - 5)) 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    local why=""
    ((rc == 124 || rc == 137)) && why=" (its timeout)"
    echo "run.sh: $name exit $rc$why after $((SECONDS - t0))s" | tee -a "$log"
}

# FlashInfer's tests last: its kernels compile with nvcc on first use (minutes, cold).
for name in ${VLMSERVE_PARTS:-tests bf16 quant offline nanobatch kernels flashinfer}; do
    run_part "$name"
done
"$PY" -m benchmarks.gpu_check --summary "$SCRATCH" 2>&1 | tee "$DEST/summary.txt"
status=${PIPESTATUS[0]}
cp "$SCRATCH/gpu_check.json" "$DEST/results.json" 2>/dev/null
echo "wall time            $((SECONDS - START))s" | tee -a "$DEST/summary.txt"
exit "$status"

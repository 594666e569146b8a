#!/usr/bin/env bash
# Downloads, here, the wheels the lent GPU machine lacks (benchmarks/device/bundle.txt:
# cp312 manylinux x86_64, pinned, no dependencies resolved on the way) into .device-bundle/
# (git-ignored), then checks them (bundle_check.py): one version of each, every need met by
# the bundle or the device's own packages, bundle + working tree under the 64 MiB that a
# device call carries. Run it in the checkout the device call sends.
#
#   bash benchmarks/device/bundle.sh [DIR]      # default DIR: .device-bundle
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR="${1:-.device-bundle}"
PY="${PYTHON:-python3}"

rm -rf "$DIR.new" && mkdir -p "$DIR.new"
# Names with versions only: pip reads no comments from the command line.
mapfile -t PINS < <(sed 's/#.*//; s/[[:space:]]//g; /^$/d' benchmarks/device/bundle.txt)
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
    -d "$DIR.new" "${PINS[@]}"
rm -rf "$DIR" && mv "$DIR.new" "$DIR"  # never a mix of an old and a new bundle
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m benchmarks.device.bundle_check "$DIR"

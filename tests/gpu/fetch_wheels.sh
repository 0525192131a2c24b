#!/usr/bin/env bash
# The wheels the device check carries (the GPU machine has Python 3.12, torch + CUDA, transformers, tqdm,
# pytest, safetensors and pyyaml, and no package index). Run here, where the index answers:
#
#   tests/gpu/fetch_wheels.sh [DEST]          cp312 manylinux wheels for the device (default tests/gpu/carry/wheels)
#   TARGET=cpu tests/gpu/fetch_wheels.sh DEST  the same packages for this machine's Python (the CPU --check),
#                                              megatron-core at the CPU pin (0.19.2 needs Python >= 3.12)
#
# Every wheel is downloaded with --no-deps: the list below is the whole closure the GPU checks import beyond
# the device's own packages (tests/gpu/run_on_device.sh --check proves it in a venv that has nothing else).
# The pins here are kept in agreement with setup.cfg's gpu extra and the Makefile by tests/test_pins.py.
set -euo pipefail
DEST="$(realpath -m "${1:-$(dirname "$0")/carry/wheels}")"
cd "$(dirname "$0")"
MCORE_DEVICE=0.19.2   # megatron-core on the device (setup.cfg gpu extra)
MCORE_CPU=0.16.1      # megatron-core on this machine (Makefile; the CPU contract tests)
CARRIED=(             # what a bare torch image lacks (pure Python or small binary wheels)
    pyzmq==27.3.0
    msgspec==0.23.0
    aiohttp==3.14.5 aiohappyeyeballs aiosignal attrs frozenlist multidict propcache yarl idna
    psutil==7.2.2
)
TARGET="${TARGET:-device}"
mkdir -p "$DEST"
pip_download() { "${PY:-python3}" -m pip download -q --no-deps --only-binary=:all: -d "$DEST" "$@" 2>&1 | grep -v "^WARNING: Location" || true; }
case "$TARGET" in
    device)
        pip_download --python-version 3.12 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 --platform any "megatron-core==$MCORE_DEVICE" "${CARRIED[@]}" ;;
    cpu)
        pip_download "megatron-core==$MCORE_CPU" "${CARRIED[@]}" ;;
    *) echo "TARGET must be device or cpu, got $TARGET" >&2; exit 2 ;;
esac
ls "$DEST"/*.whl >/dev/null
du -sh "$DEST"

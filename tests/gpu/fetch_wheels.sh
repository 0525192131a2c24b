#!/usr/bin/env bash
# Download here (a machine with the package registry) what the GPU machine lacks, into tests/gpu/wheels/
# (git-ignored; the device tool carries it: run(..., carry=["tests/gpu/wheels"])). The device has
# Python 3.12 and torch + CUDA but no registry; megatron-core is pure Python (~2.4 MB).
# EXTRA=1 also fetches transformers and its binary helpers for cp312 (~15 MB), for the parity checks.
set -euo pipefail
cd "$(dirname "$0")"
mkdir -p wheels
pip download --no-deps --python-version 3.12 --only-binary=:all: -d wheels megatron-core==0.19.2
if [ "${EXTRA:-0}" = 1 ]; then
    pip download --no-deps --python-version 3.12 --only-binary=:all: -d wheels \
        transformers==4.57.1 tokenizers==0.22.1 safetensors==0.6.2 huggingface-hub==0.35.3 regex pyyaml
fi
du -sh wheels

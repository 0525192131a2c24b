#!/usr/bin/env bash
# The prepared GPU check (../shared/DESIGN.md "When a GPU machine is available"): one H100/H200, Python 3.12,
# torch + CUDA, transformers, tqdm, pytest, safetensors, pyyaml preinstalled, NO package index; files under
# $OUT come back. Its steps' timeouts add up to 7 min (420 s; the budget is 8).
#
#   here:    tests/gpu/run_on_device.sh --check    builds tests/gpu/carry/ (git-ignored) and proves it on CPU
#   device:  run(command="bash tests/gpu/run_on_device.sh", carry=["tests/gpu/carry"], timeout_s=480)
#
# The carry (~35 MB): carry/wheels/ (cp312 manylinux wheels, tests/gpu/fetch_wheels.sh: megatron-core 0.19.2,
# pyzmq, msgspec, aiohttp and its deps, psutil) and carry/cache/tiny-qwen2-seed0/ (the tiny model as
# safetensors + config + tokenizer files: resolve_model("tiny-qwen2") finds it, no GGUF needed).
#
# Device steps (each bounded by `timeout`, each writes into $OUT; a failed step does not stop the others):
#   1. environment (30 s)
#   2. install the carried wheels with --no-deps --no-index into /tmp/tir-site (60 s)
#   3. pytest -m gpu: tests/megatron_tir/policy/test_learner_gpu.py, rollout engines' GPU tests (120 s)
#   4. tests/gpu/device_checks.py: NCCL update_policy, bf16 log-prob parity, per-layer activations of
#      7B / 32B per-rank layers vs the planner, learner tokens/s, loss-path memory vs the planner, and
#      with Transformer Engine: TE spec names, _extra_state, FP8 + SP micro-batch shapes (150 s)
#   5. tests/gpu/nccl_sync_check.py: the per-stage sender's NCCL broadcast of 7B-sized buckets (60 s)
#
# --check (CPU, here; 2-4 min): what it proves and what it cannot (tests/gpu/README.md) --
#   a. the carry is built: cp312 wheels for the device and the tiny model's files;
#   b. every carried wheel's own requirements (for Python 3.12 on Linux) are carried or preinstalled on
#      the device (the list DEVICE_HAS below): nothing a --no-deps install leaves out is missing;
#   c. a fresh venv of this machine's Python (3.11) that installs ONLY from local folders (--no-index:
#      the on-disk CPU torch as the device's torch, the device's other preinstalled packages and the
#      carried packages as cp311 wheels, carried ones with --no-deps into a --target folder as on the
#      device) imports everything the GPU checks import and loads the carried tiny model with
#      transformers and with the learner. It runs megatron-core 0.16.1 there (0.19.2 needs Python 3.12,
#      and no CPU torch for 3.12 is on disk): 0.19.2 itself is covered by (b) and the contract tests
#      (tests/megatron_tir/policy/test_mcore_versions.py), not imported. CUDA, NCCL and TE are not checked.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
CARRY=tests/gpu/carry
GPU_TESTS="tests/megatron_tir/policy/test_learner_gpu.py tests/megatron_tir/rollout/engines/test_engines_gpu.py"
DEVICE_HAS="torch transformers tqdm pytest safetensors pyyaml numpy packaging filelock typing-extensions
            sympy networkx jinja2 fsspec huggingface-hub tokenizers regex requests"

check() {
    set -e
    local py="${PROJECT_PY:-$ROOT/.venv/bin/python}" work="${CHECK_DIR:-/tmp/tir-device-check}"
    echo "== carry: wheels for the device"
    PY="$py" tests/gpu/fetch_wheels.sh "$CARRY/wheels"
    echo "== carry: the tiny model as files (built in a cache of its own: SmolLM2, its tokenizer's source, stays here)"
    mkdir -p "$work" "$CARRY/cache"
    MEGATRON_TIR_CACHE="$work/model-cache" "$py" -c \
        "from megatron_tir.model_sources import resolve_model; print(resolve_model('tiny-qwen2'))" 2>&1 | tail -1
    rm -rf "$CARRY/cache/tiny-qwen2-seed0" && cp -r "$work/model-cache/tiny-qwen2-seed0" "$CARRY/cache/"
    echo "== the carried wheels' requirements are carried or on the device"
    "$py" tests/gpu/carry_requirements.py "$CARRY/wheels" $DEVICE_HAS
    echo "== a fresh venv from local folders only (this machine's Python)"
    rm -rf "$work/venv" "$work/site" "$work/carried" && mkdir -p "$work/baseline" "$work/carried"
    local tv; tv=$("$py" -c "import transformers; print(transformers.__version__)")
    "$py" -m pip download -q --only-binary=:all: -d "$work/baseline" "transformers==$tv" tqdm pytest safetensors \
        pyyaml filelock typing-extensions "setuptools>=77.0.3" sympy networkx jinja2 fsspec packaging 2>&1 \
        | grep -v "^WARNING: Location" || true
    PY="$py" TARGET=cpu tests/gpu/fetch_wheels.sh "$work/carried" >/dev/null
    "${CHECK_PYTHON:-python3.11}" -m venv "$work/venv"  # no --system-site-packages: nothing but the folders
    "$work/venv/bin/python" -m pip install -q --no-index --find-links /opt/wheels --find-links "$work/baseline" \
        torch==2.13.0 "transformers==$tv" tqdm pytest safetensors pyyaml
    "$work/venv/bin/python" -m pip install -q --no-index --no-deps --target "$work/site" "$work/carried"/*.whl
    echo "== imports and the tiny model in that venv"
    PYTHONPATH="$ROOT:$work/site" MEGATRON_TIR_CACHE="$ROOT/$CARRY/cache" OMP_NUM_THREADS=2 \
        "$work/venv/bin/python" tests/gpu/device_checks.py --imports-only
    echo "== pytest collects the GPU tests in that venv (conftest imports included)"
    PYTHONPATH="$ROOT:$work/site" MEGATRON_TIR_CACHE="$ROOT/$CARRY/cache" "$work/venv/bin/python" -m pytest \
        -m gpu --collect-only -q -p no:cacheprovider $GPU_TESTS | tail -1
    du -sh "$CARRY"
    echo "check ok"
}

if [ "${1:-}" = "--check" ]; then
    check
    exit $?
fi

OUT="${OUT:?set OUT to the output directory}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/run_on_device.log") 2>&1
t0=$(date +%s)
step() { echo "=== $(($(date +%s) - t0)) s: $*"; }

step "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
timeout 30 python - <<'PY' | tee "$OUT/env.txt"
import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
for mod in ("megatron.core", "transformers", "transformer_engine", "sglang", "zmq", "msgspec"):
    try:
        m = __import__(mod, fromlist=["x"]); print(mod, getattr(m, "__version__", "?"))
    except Exception as e:  # noqa: BLE001
        print(mod, "missing:", type(e).__name__)
PY

step "install carried wheels (--no-deps --no-index)"
SITE=/tmp/tir-site
mkdir -p "$SITE"
if ls "$CARRY"/wheels/*.whl >/dev/null 2>&1; then
    timeout 60 python -m pip install -q --no-deps --no-index --target "$SITE" "$CARRY"/wheels/*.whl 2>&1 | tail -3
else
    echo "no $CARRY/wheels/*.whl carried (run tests/gpu/run_on_device.sh --check here first)"
fi
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=4 MEGATRON_TIR_CACHE="$PWD/$CARRY/cache"
python -c "import megatron.core as m; print('megatron-core', m.__version__)" | tee -a "$OUT/env.txt"

step "pytest -m gpu"
timeout 120 python -m pytest -m gpu -q -p no:cacheprovider --junitxml="$OUT/pytest_gpu.xml" $GPU_TESTS \
    > "$OUT/pytest_gpu.log" 2>&1
echo "pytest -m gpu exit status $?" | tee -a "$OUT/pytest_gpu.log"; tail -5 "$OUT/pytest_gpu.log"

step "device checks"
timeout 150 python tests/gpu/device_checks.py --out "$OUT/device_checks.json" 2>&1 | tee "$OUT/device_checks.log"
echo "device checks exit status ${PIPESTATUS[0]}"

step "NCCL weight-sync broadcast, 7B-sized buckets"
timeout 60 python tests/gpu/nccl_sync_check.py --out "$OUT/nccl_sync.json" 2>&1 | tee "$OUT/nccl_sync.log"
echo "nccl sync check exit status ${PIPESTATUS[0]}"
step "done"

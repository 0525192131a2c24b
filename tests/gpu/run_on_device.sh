#!/usr/bin/env bash
# The prepared GPU check (../shared/DESIGN.md "When a GPU machine is available"): one H200, Python 3.12,
# torch + CUDA preinstalled, no package registry, files under $OUT come back. Designed for < 6 minutes.
#
#   here:    tests/gpu/fetch_wheels.sh            (megatron-core 0.19.2 wheel into tests/gpu/wheels/)
#   device:  run(command="bash tests/gpu/run_on_device.sh", carry=["tests/gpu/wheels"], timeout_s=480)
#
# Steps (each bounded by `timeout`, each writes into $OUT; a failed step does not stop the others):
#   1. install the carried wheels with --no-deps into $OUT-independent /tmp/tir-site (nothing else)
#   2. pytest -m gpu  (tests/megatron_tir/policy/test_learner_gpu.py, rollout engines' GPU tests)
#   3. tests/gpu/device_checks.py: NCCL update_policy on tiny Qwen2 with the local spec, bf16
#      log-prob parity against transformers, per-layer activation bytes of per-rank-shaped 7B / 32B
#      layers at the recipes' token budgets (with and without full recomputation) against the
#      capacity planner, learner tokens/s  -> $OUT/device_checks.json
#   4. tests/gpu/nccl_sync_check.py: the per-stage sender's NCCL broadcast of a Qwen2.5-7B-sized
#      flattened bucket set (15.2 GB bf16, 256 MiB buckets) vs a device copy -> $OUT/nccl_sync.json
set -uo pipefail
OUT="${OUT:?set OUT to the output directory}"
mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
exec > >(tee -a "$OUT/run_on_device.log") 2>&1
t0=$(date +%s)
step() { echo "=== $(($(date +%s) - t0)) s: $*"; }

step "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
python - <<'PY' | tee "$OUT/env.txt"
import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
for mod in ("megatron.core", "transformers", "transformer_engine", "sglang"):
    try:
        m = __import__(mod, fromlist=["x"]); print(mod, getattr(m, "__version__", "?"))
    except Exception as e:  # noqa: BLE001
        print(mod, "missing:", type(e).__name__)
PY

step "install carried wheels (--no-deps)"
SITE=/tmp/tir-site
mkdir -p "$SITE"
if ls tests/gpu/wheels/*.whl >/dev/null 2>&1; then
    python -m pip install --no-deps --no-index --target "$SITE" tests/gpu/wheels/*.whl 2>&1 | tail -3
else
    echo "no tests/gpu/wheels/*.whl carried: using what the device has"
fi
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=4 MEGATRON_TIR_CACHE=/tmp/tir-cache
python -c "import megatron.core as m; print('megatron-core', m.__version__)" | tee -a "$OUT/env.txt"

step "pytest -m gpu"
timeout 170 python -m pytest -m gpu -q -p no:cacheprovider --junitxml="$OUT/pytest_gpu.xml" \
    tests/megatron_tir/policy/test_learner_gpu.py tests/megatron_tir/rollout/engines/test_engines_gpu.py \
    > "$OUT/pytest_gpu.log" 2>&1
echo "pytest -m gpu exit status $?" | tee -a "$OUT/pytest_gpu.log"; tail -5 "$OUT/pytest_gpu.log"

step "device checks"
timeout 200 python tests/gpu/device_checks.py --out "$OUT/device_checks.json" 2>&1 | tee "$OUT/device_checks.log"
echo "device checks exit status ${PIPESTATUS[0]}"

step "NCCL weight-sync broadcast, 7B-sized buckets"
timeout 120 python tests/gpu/nccl_sync_check.py --out "$OUT/nccl_sync.json" 2>&1 | tee "$OUT/nccl_sync.log"
echo "nccl sync check exit status ${PIPESTATUS[0]}"
step "done"

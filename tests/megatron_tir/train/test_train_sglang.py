"""``megatron-tir train`` against an SGLang server of its own (a fake server process,
tests/megatron_tir/rollout/engines/fake_sglang.py: a LocalEngine behind SGLang 0.5.23's HTTP API
that joins weight-update groups with SGLang's own code): the rollouts come from the server and
after every update the trainer's per-stage sender (``rollout/sync/stages.py``) brings the server
to the step's weight version, flattened buckets on stage 0's group."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
FAKE_SERVER = ROOT / "tests" / "megatron_tir" / "rollout" / "engines" / "fake_sglang.py"


def test_tiny_cpu_trains_against_an_sglang_server_synced_per_stage(tmp_path):
    from megatron_tir.model_sources import resolve_model
    from megatron_tir.ports import free_port
    from megatron_tir.rollout.engines.sglang import SGLangServer, SGLangServerConfig

    server = SGLangServer(SGLangServerConfig(model_path=str(resolve_model("tiny-qwen2")), port=free_port(),
                                             random_seed=0, launcher=(sys.executable, str(FAKE_SERVER)),
                                             log_file=str(tmp_path / "server.log"))).start()
    try:
        server.wait_healthy(timeout_s=120, poll_s=0.2)
        run = tmp_path / "run"
        p = subprocess.run([sys.executable, "-m", "megatron_tir.cli", "train", "--recipe", "tiny-cpu",
                            "--set", "engine.kind=sglang", "--set", f"engine.urls={server.url}",
                            "--set", "data.eval_size=0", "--out", str(run)],
                           env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                           capture_output=True, text=True, timeout=900, cwd=ROOT)
        assert p.returncode == 0, p.stderr[-3000:]
        with urllib.request.urlopen(f"{server.url}/fake_state", timeout=30) as response:
            state = json.loads(response.read())
    finally:
        server.stop()
    rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert state["weight_version"] == "2" and not state["contract_errors"]  # one sync per step
    assert {u["group"] for u in state["received"]} == {"megatron_tir_weights-0-pp0"}
    assert {u["load_format"] for u in state["received"]} == {"flattened_bucket"}
    assert "/generate" in state["paths"]

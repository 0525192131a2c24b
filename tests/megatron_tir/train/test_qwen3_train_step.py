"""One tiny-cpu training step with a Qwen3 and a Qwen3-MoE policy (the models as HF directories):
rollouts from the local engine (slot decoder / HF forward), old log-probs, the update, weight sync."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow  # one tiny-cpu step in its own process (~40-60 s)
@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_one_step(name, tmp_path):
    from megatron_tir.model_sources import resolve_model

    model_dir = resolve_model(name)  # an ordinary HF directory, as a user would pass one
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "megatron_tir.cli", "train", "--recipe", "tiny-cpu",
                        "--set", f"model={model_dir}", "--set", "trainer.steps=1", "--set", "data.eval_size=0",
                        "--set", "trainer.progress=false", "--out", str(run)],
                       env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    (line,) = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert line["train/optimizer_steps"] >= 1 and line["train/grad_norm"] > 0

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


@pytest.mark.slow  # one tiny-cpu step each (~40-60 s)
@pytest.mark.parametrize("replay", ["none", "old_pass"])
def test_one_moe_step_with_routing_replay(replay, tmp_path):
    """Two mini-batches, so the second runs on a moved router: the top-k changed share is reported with
    replay on and off."""
    from megatron_tir.model_sources import resolve_model

    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "megatron_tir.cli", "train", "--recipe", "tiny-cpu",
                        "--set", f"model={resolve_model('tiny-qwen3-moe')}", "--set", "trainer.steps=1",
                        "--set", "data.eval_size=0", "--set", "trainer.progress=false",
                        "--set", "trainer.ppo.mini_batches=2", "--set", "learner.lr=0.05",
                        "--set", f"trainer.ppo.routing_replay={replay}", "--out", str(run)],
                       env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    (line,) = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert line["train/optimizer_steps"] == 2
    # the second mini-batch runs on a router the first moved (lr 0.05): some top-k changed (0.47 measured), not all
    assert 0 < line["routing/topk_changed_share"] < 1


def test_rollout_replay_is_refused_with_one_line(tmp_path):
    p = subprocess.run([sys.executable, "-m", "megatron_tir.cli", "train", "--recipe", "tiny-cpu",
                        "--set", "trainer.ppo.routing_replay=rollout", "--out", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode != 0
    assert "routing_replay=rollout needs an engine that reports routed experts (engine.kind=local does not" \
        in p.stderr.strip().splitlines()[-1]

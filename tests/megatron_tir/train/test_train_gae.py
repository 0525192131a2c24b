"""PPO with a masked critic in the trainer: GAE advantages from the critic's values (checked by
hand from given values), and tiny-cpu runs with ``trainer.ppo.advantage=gae``: the
critic trains beside the policy, is saved as a second named learner and is restored on resume."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_tir.policy.learner_contract import TrainBatch
from megatron_tir.rl.critic import explained_variance
from megatron_tir.train.config import apply_overrides
from megatron_tir.train.recipes import load_recipe
from megatron_tir.train.critic_update import CriticConfig, critic_metrics, gae_advantages

ROOT = Path(__file__).resolve().parents[3]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def test_gae_advantages_by_hand():
    # row 0: prompt, 2 model tokens, 1 feedback, 1 model token; row 1: 2 model tokens (wrong answer)
    mask = torch.tensor([[0, 1, 1, 0, 1], [0, 1, 1, 0, 0]], dtype=torch.float32)
    batch = TrainBatch(tokens_BT=torch.zeros(2, 5, dtype=torch.long), attention_mask_BT=torch.ones(2, 5, dtype=torch.bool),
                       loss_mask_BT=mask, extras={"advantages_BT": torch.zeros(2, 5)})
    values = torch.tensor([[9.0, 0.5, 0.25, 7.0, 0.5], [9.0, 0.5, 0.5, 0.0, 0.0]])
    out, stats = gae_advantages(batch, torch.tensor([1.0, 0.0]), values, CriticConfig(whiten="off"),
                                model_mask_BT=mask)
    metrics = critic_metrics(stats)
    # gamma = lam = 1: A_t = R - V(s_t) on model tokens; the feedback token is skipped
    assert out.extras["advantages_BT"].tolist() == [[0, 0.5, 0.75, 0, 0.5], [0, -0.5, -0.5, 0, 0]]
    assert out.extras["returns_BT"].tolist() == [[0, 1, 1, 0, 1], [0, 0, 0, 0, 0]]
    assert out.extras["old_values_BT"][0, 3] == 0  # the feedback token's value is masked out
    assert metrics["critic/value_mean_correct"] == pytest.approx(1.25 / 3)
    assert metrics["critic/value_mean_wrong"] == pytest.approx(0.5) and metrics["critic/kl_in_reward"] == 0
    ev = explained_variance(out.extras["old_values_BT"], out.extras["returns_BT"], mask)  # from the sums: the same
    assert metrics["critic/explained_variance"] == pytest.approx(float(ev), abs=1e-6)
    whitened, _ = gae_advantages(batch, torch.tensor([1.0, 0.0]), values, CriticConfig(), model_mask_BT=mask)
    a = whitened.extras["advantages_BT"][mask > 0]
    assert float(a.mean()) == pytest.approx(0.0, abs=1e-6) and float(a.std(unbiased=False)) == pytest.approx(1, rel=1e-3)
    raw = torch.tensor([0.5, 0.75, 0.5, -0.5, -0.5])  # the unwhitened advantages above, model tokens in order
    rms, _ = gae_advantages(batch, torch.tensor([1.0, 0.0]), values, CriticConfig(whiten="rms"), model_mask_BT=mask)
    assert rms.extras["advantages_BT"][mask > 0].tolist() == pytest.approx((raw / raw.pow(2).mean().sqrt()).tolist())


def test_rms_whitening_keeps_the_signal_of_a_lone_row():
    """One correct row left in the update (its group's void rows dropped by the mode) and a fresh
    critic (values 0): centring erases its advantage, ``rms`` keeps it at +1 on every model token."""
    mask = torch.tensor([[0, 1, 1, 1]], dtype=torch.float32)
    batch = TrainBatch(tokens_BT=torch.zeros(1, 4, dtype=torch.long), attention_mask_BT=torch.ones(1, 4, dtype=torch.bool),
                       loss_mask_BT=mask, extras={})
    zero = torch.zeros(1, 4)
    centred, stats = gae_advantages(batch, torch.tensor([1.0]), zero, CriticConfig(whiten="batch"), model_mask_BT=mask)
    assert centred.extras["advantages_BT"].abs().max() == 0
    assert math.isnan(critic_metrics(stats)["critic/explained_variance"])  # constant returns: undefined
    kept, _ = gae_advantages(batch, torch.tensor([1.0]), zero, CriticConfig(whiten="rms"), model_mask_BT=mask)
    assert kept.extras["advantages_BT"][0].tolist() == pytest.approx([0, 1, 1, 1], abs=1e-6)
    with pytest.raises(ValueError, match="whiten must be one of batch, rms, off"):
        CriticConfig(whiten="yes")


def test_kl_in_reward_needs_gae_and_is_a_separate_switch():
    with pytest.raises(ValueError, match="needs trainer.ppo.advantage=gae"):
        apply_overrides(load_recipe("tiny-cpu"), ["critic.kl_reward_coef=0.01"])
    cfg = apply_overrides(load_recipe("tiny-cpu"), ["trainer.ppo.advantage=gae", "critic.kl_reward_coef=0.01"])
    assert cfg.trainer.loss.kl_coef == 0 and cfg.critic.kl_reward_coef == 0.01
    with pytest.raises(ValueError, match="advantage must be one of"):
        apply_overrides(load_recipe("tiny-cpu"), ["trainer.ppo.advantage=vtrace"])


def _train(*args):
    return subprocess.run([sys.executable, "-m", "megatron_tir.cli", "train", *args],
                          env=ENV, capture_output=True, text=True, timeout=900, cwd=ROOT)


GAE_RUN = ("--recipe", "tiny-cpu", "--set", "trainer.ppo.advantage=gae", "--set", "critic.lr=1e-4",
           "--set", "critic.warmup_steps=1", "--set", "critic.kl_reward_coef=0.01")


def test_tiny_cpu_with_a_critic_trains_saves_and_resumes(tmp_path):
    """Policy and critic both survive a resume: step 3 after a resume at step 2 equals step 3 of
    a run that never stopped (losses of both learners)."""
    run = tmp_path / "run"
    p = _train(*GAE_RUN, "--set", "trainer.steps=2", "--out", str(run))
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    for step in (1, 2):
        assert math.isfinite(rows[step]["critic/value_loss"]) and rows[step]["critic/kl_in_reward"] == 1.0
        assert "critic/explained_variance" in rows[step]
    assert rows[1]["critic/warmup"] == 1.0 and "train/loss" not in rows[1]  # critic-only warm-up
    assert rows[2]["critic/warmup"] == 0.0 and math.isfinite(rows[2]["train/loss"])
    step_dir = run / "checkpoints" / "step_2"
    assert (step_dir / "policy").is_dir() and (step_dir / "critic").is_dir()
    p = _train("--resume", str(run), "--set", "trainer.steps=3")
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    assert math.isfinite(rows[3]["critic/value_loss"])
    p = _train(*GAE_RUN, "--set", "trainer.steps=3", "--out", str(tmp_path / "straight"))
    assert p.returncode == 0, p.stderr[-3000:]
    straight = {r["step"]: r for r in map(json.loads, (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines())}
    for key in ("critic/value_loss", "critic/grad_norm", "train/loss", "train/grad_norm", "rollout/reward"):
        assert rows[3][key] == pytest.approx(straight[3][key], rel=1e-4, abs=1e-6), key

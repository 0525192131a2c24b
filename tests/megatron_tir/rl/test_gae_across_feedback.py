"""``critic.gae_across_feedback``: ``reset`` against ZeroTIR's script's recurrence, ``carry`` against
verl's multi-turn GAE, both written out in numpy here and run on the same rows; and the asymmetric
value clip of ZeroTIR's fork.

Sources, read (not copied) at the cited commits:
* yyht/openrlhf_async_pipline 63b6159 ``openrlhf/trainer/ppo_utils/experience_maker.py``
  ``get_advantages_and_returns`` (``--use_env_mask``): values and rewards times ``action_mask`` and
  ``env_mask``; ``nextvalues = values[:, t + 1]``; ``lastgaelam = delta + gamma * lambd * lastgaelam``
  then ``lastgaelam *= env_mask[:, t]``; returns = advantages + values, both times ``env_mask``.
  The script's tensors hold the response only (``action_mask``: its tokens, ``env_mask``: the model's).
* verl ``trainer/ppo/core_algos.py`` ``compute_gae_advantage_return``: on an observation token
  (``response_mask`` 0) ``nextvalues`` and ``lastgaelam`` keep their values ("skip values and
  TD-error on observation tokens"); returns = advantages + values.
* ``openrlhf/models/loss.py`` ``ValueLoss`` at 63b6159:
  ``old_values + (values - old_values).clamp(-clip_eps, clip_eps_high)``.
"""

import numpy as np
import pytest
import torch

from megatron_tir.rl.critic import gae_BT, token_rewards_BT, value_loss_BT
from megatron_tir.train.critic_update import CriticConfig, warmup_unfiltered

# Three rows in log-prob columns: prompt columns first (mask 0), the response's columns
# [START, END), then padding; 1 = model token, 0 inside the response = feedback.
# row 0: turn 0 (3 tokens), feedback 2, turn 1 (2 tokens), padding 2
# row 1: turn 0 (2), feedback 1, turn 1 (1), feedback 3, turn 2 (3), no padding
# row 2: one turn (4 tokens), padding 4
ROWS = [[0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 0],
        [0, 1, 1, 0, 1, 0, 0, 0, 1, 1, 1],
        [0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0]]
START, END = [2, 1, 3], [9, 11, 7]


def _rows(seed: int):
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor(ROWS, dtype=torch.float32)
    values = torch.randn(mask.shape, generator=g)  # junk off the model tokens too
    logp, ref = torch.randn(mask.shape, generator=g) * 0.1, torch.randn(mask.shape, generator=g) * 0.1
    rewards = torch.tensor([1.0, 0.0, 1.0])
    return mask, values, token_rewards_BT(rewards, mask, logprobs_BT=logp, ref_logprobs_BT=ref, kl_coef=0.05)


def _script_reset(values, rewards, action_mask, env_mask, gamma, lambd):
    """ZeroTIR's script's recurrence (numpy), on the response columns."""
    values = values * action_mask * env_mask
    rewards = rewards * action_mask * env_mask
    n = rewards.shape[1]
    lastgaelam, out = np.zeros(rewards.shape[0]), []
    for t in reversed(range(n)):
        nextvalues = values[:, t + 1] if t < n - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lambd * lastgaelam
        lastgaelam = lastgaelam * env_mask[:, t]
        out.append(lastgaelam)
    adv = np.stack(out[::-1], axis=1)
    returns = adv + values
    return adv * env_mask, returns * env_mask


def _verl_carry(rewards, values, response_mask, gamma, lam):
    """verl's multi-turn GAE (numpy): observation tokens carry nextvalues and lastgaelam unchanged."""
    n = rewards.shape[1]
    nextvalues, lastgaelam, out = np.zeros(rewards.shape[0]), np.zeros(rewards.shape[0]), []
    for t in reversed(range(n)):
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        new = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * response_mask[:, t] + (1 - response_mask[:, t]) * nextvalues
        lastgaelam = new * response_mask[:, t] + (1 - response_mask[:, t]) * lastgaelam
        out.append(lastgaelam)
    adv = np.stack(out[::-1], axis=1)
    return adv, adv + values


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (1.0, 0.5)])
def test_reset_is_the_scripts_recurrence(gamma, lam):
    mask, values, rewards = _rows(0)
    adv, ret = gae_BT(rewards, values, mask, gamma=gamma, lam=lam, across_feedback="reset")
    for b, (start, end) in enumerate(zip(START, END)):
        cols = slice(start, end)  # the script's tensors: the response only (its action_mask is all 1)
        env = mask[b:b + 1, cols].numpy()
        want_adv, want_ret = _script_reset(values[b:b + 1, cols].numpy(), rewards[b:b + 1, cols].numpy(),
                                           np.ones_like(env), env, gamma, lam)
        assert adv[b, cols].numpy() == pytest.approx(want_adv[0], abs=1e-6)
        assert ret[b, cols].numpy() == pytest.approx(want_ret[0], abs=1e-6)
    assert (adv * (1 - mask)).abs().sum() == 0 and (ret * (1 - mask)).abs().sum() == 0


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95)])
def test_carry_is_verls_multi_turn_gae(gamma, lam):
    mask, values, rewards = _rows(1)
    adv, ret = gae_BT(rewards, values, mask, gamma=gamma, lam=lam, across_feedback="carry")
    m = mask.numpy()
    want_adv, want_ret = _verl_carry(rewards.numpy(), values.numpy() * m, m, gamma, lam)
    assert (adv.numpy() * m) == pytest.approx(want_adv * m, abs=1e-6)
    assert ret.numpy() == pytest.approx(want_ret * m, abs=1e-6)


def test_reset_and_carry_by_hand_on_an_outcome_reward():
    """gamma = lam = 1, no KL: carry gives R - V on every model token; reset gives -V on the turns
    before feedback (return 0) and R - V on the last turn only (the issue's reading of the script)."""
    mask = torch.tensor([ROWS[0]], dtype=torch.float32)
    values = torch.arange(11, dtype=torch.float32)[None] / 10
    rewards = token_rewards_BT(torch.tensor([1.0]), mask)
    on = mask[0] > 0
    carry, _ = gae_BT(rewards, values, mask, across_feedback="carry")
    reset, ret = gae_BT(rewards, values, mask, across_feedback="reset")
    assert carry[0, on].tolist() == pytest.approx((1 - values[0, on]).tolist())
    assert reset[0, [2, 3, 4]].tolist() == pytest.approx([-0.2, -0.3, -0.4])
    assert reset[0, [7, 8]].tolist() == pytest.approx([1 - 0.7, 1 - 0.8])
    assert ret[0, [2, 3, 4]].tolist() == pytest.approx([0.0, 0.0, 0.0]) and ret[0, [7, 8]].tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="across_feedback"):
        gae_BT(rewards, values, mask, across_feedback="skip")


def test_asymmetric_value_clip_is_the_forks():
    g = torch.Generator().manual_seed(2)
    v, old, ret = (torch.randn(4, 9, generator=g) for _ in range(3))
    loss, clipped = value_loss_BT(v, old, ret, clip=0.2, clip_high=0.28)
    v_clip = old + np.clip((v - old).numpy(), -0.2, 0.28)
    want = 0.5 * np.maximum((v_clip - ret.numpy()) ** 2, ((v - ret) ** 2).numpy())
    assert loss.numpy() == pytest.approx(want, abs=1e-6)
    sym, _ = value_loss_BT(v, old, ret, clip=0.2)
    assert torch.equal(sym, value_loss_BT(v, old, ret, clip=0.2, clip_high=0.2)[0])
    assert not torch.equal(sym, loss)  # the draw has value moves in (0.2, 0.28]


def test_critic_config_fields():
    assert CriticConfig().gae_across_feedback == "carry" and CriticConfig().value_clip_high is None
    for bad in ({"gae_across_feedback": "skip"}, {"value_clip_high": 0.0}, {"value_clip": None, "value_clip_high": 0.3},
                {"aggregation": "sum"}):
        with pytest.raises(ValueError):
            CriticConfig(**bad)
    cfg = CriticConfig(warmup_steps=10, filter_in_warmup=False)
    assert [warmup_unfiltered(cfg, uses_critic=True, step=s) for s in (1, 10, 11)] == [True, True, False]
    assert not warmup_unfiltered(cfg, uses_critic=False, step=1)
    assert not warmup_unfiltered(CriticConfig(warmup_steps=10), uses_critic=True, step=1)

"""GAE with feedback spans, value loss, KL in the reward, REINFORCE++-baseline and the
behaviour weights of the decoupled objective, each against a hand or numpy computation."""

import math

import numpy as np
import pytest
import torch

from megatron_tir.rl.advantages import reinforce_pp_baseline_advantages_BT
from megatron_tir.rl.critic import explained_variance, gae_BT, token_rewards_BT, value_loss_BT
from megatron_tir.rl.correction import correct, from_async_alias

# one row: prompt col 0, model tokens 1-2, feedback 3-4, model token 5, padding 6
MASK = torch.tensor([[0, 1, 1, 0, 0, 1, 0]], dtype=torch.float32)
VALUES = torch.tensor([[9.0, 0.2, 0.5, 7.0, -3.0, 0.6, 4.0]])  # junk off the model tokens


def _hand_gae(r, v, gamma, lam):
    """Over the model tokens only (feedback is not a step), right to left."""
    adv, nxt, last = [0.0] * len(r), 0.0, 0.0
    for i in reversed(range(len(r))):
        delta = r[i] + gamma * nxt - v[i]
        last = delta + gamma * lam * last
        adv[i], nxt = last, v[i]
    return adv


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.8), (1.0, 0.5)])
def test_gae_skips_feedback_tokens(gamma, lam):
    rew = token_rewards_BT(torch.tensor([1.0]), MASK)
    assert rew.tolist() == [[0, 0, 0, 0, 0, 1, 0]]
    adv, ret = gae_BT(rew, VALUES, MASK, gamma=gamma, lam=lam)
    want = _hand_gae([0.0, 0.0, 1.0], [0.2, 0.5, 0.6], gamma, lam)
    assert adv[0, [1, 2, 5]].tolist() == pytest.approx(want, abs=1e-6)
    assert adv[0, [0, 3, 4, 6]].abs().sum() == 0 and ret[0, [0, 3, 4, 6]].abs().sum() == 0
    assert ret[0, [1, 2, 5]].tolist() == pytest.approx([a + v for a, v in zip(want, [0.2, 0.5, 0.6])], abs=1e-6)
    if gamma == lam == 1:  # outcome reward: A_t = R - V(s_t)
        assert adv[0, [1, 2, 5]].tolist() == pytest.approx([0.8, 0.5, 0.4], abs=1e-6)


def test_values_on_feedback_tokens_change_nothing():
    rew = token_rewards_BT(torch.tensor([1.0]), MASK)
    other = VALUES.clone()
    other[0, [0, 3, 4, 6]] = torch.tensor([-50.0, 123.0, 0.0, 8.0])
    a1, r1 = gae_BT(rew, VALUES, MASK, gamma=0.9, lam=0.95)
    a2, r2 = gae_BT(rew, other, MASK, gamma=0.9, lam=0.95)
    assert torch.equal(a1, a2) and torch.equal(r1, r2)
    l1, _ = value_loss_BT(VALUES, VALUES * 0.5, r1, clip=0.2)
    l2, _ = value_loss_BT(other, other * 0.5, r2, clip=0.2)
    assert torch.equal(l1 * MASK, l2 * MASK)


def test_value_loss_clipped_by_hand():
    v, old, ret = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.5, 0.0]]), torch.tensor([[0.0, 0.3]])
    loss, clipped = value_loss_BT(v, old, ret, clip=0.2)
    # token 0: v_clip = 0.7; max(1.0, 0.49) / 2 = 0.5 -- token 1: v = v_clip = 0: 0.09 / 2
    assert loss.tolist()[0] == pytest.approx([0.5, 0.045])
    assert clipped.tolist() == [[0.0, 0.0]]
    loss, clipped = value_loss_BT(torch.tensor([[0.0]]), torch.tensor([[1.0]]), torch.tensor([[0.0]]), clip=0.2)
    assert loss.item() == pytest.approx(0.5 * 0.8 ** 2) and clipped.item() == 1.0  # v_clip = 0.8 is worse
    loss, _ = value_loss_BT(v, old, ret, clip=None)
    assert loss.tolist()[0] == pytest.approx([0.5, 0.045])


def test_kl_in_reward_by_hand():
    logp = torch.tensor([[0.0, -1.0, -2.0, 0.0, 0.0, -0.5, 0.0]])
    ref = torch.tensor([[5.0, -1.5, -1.0, 9.0, 9.0, -0.5, 9.0]])
    r = token_rewards_BT(torch.tensor([1.0]), MASK, logprobs_BT=logp, ref_logprobs_BT=ref, kl_coef=0.1)
    # k1 = logp - ref on model tokens: 0.5, -1.0, 0.0; reward 1 on the last model token (col 5)
    assert r.tolist()[0] == pytest.approx([0, -0.05, 0.1, 0, 0, 1.0, 0])
    with pytest.raises(ValueError, match="reference"):
        token_rewards_BT(torch.tensor([1.0]), MASK, kl_coef=0.1)


def test_explained_variance():
    ret, m = torch.tensor([[1.0, 2.0, 3.0, 0.0]]), torch.tensor([[1, 1, 1, 0]])
    assert explained_variance(ret, ret, m).item() == pytest.approx(1.0)
    assert explained_variance(torch.full_like(ret, 2.0), ret, m).item() == pytest.approx(0.0, abs=1e-6)
    # returns that do not vary (one row of an outcome reward, gamma = 1): undefined, not "perfect"
    flat = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert math.isnan(explained_variance(torch.zeros_like(flat), flat, m).item())


def test_reinforce_pp_baseline_equals_numpy():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    group = torch.tensor([0, 0, 0, 1, 1, 1])
    stats = torch.tensor([True, True, True, True, True, False])  # row 5: an infrastructure failure
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1], [1, 0, 0], [1, 1, 1]], dtype=torch.float32)
    got = reinforce_pp_baseline_advantages_BT(rewards, group, stats, mask)
    r, s, m = rewards.numpy(), stats.numpy(), mask.numpy()
    centred = np.zeros(6)
    for g in (0, 1):
        idx = (group.numpy() == g) & s
        centred[idx] = r[idx] - r[idx].mean()
    counted = m * s[:, None]
    vals = np.repeat(centred[:, None], 3, axis=1)[counted > 0]
    want = (centred[:, None] - vals.mean()) / (vals.std(ddof=1) + 1e-8) * counted
    assert got.numpy() == pytest.approx(want, abs=1e-6)
    assert got[5].abs().sum() == 0


def behaviour_weights_BT(prox_BT, behav_BT, *, cap=2.0, mode="clamp"):
    """The former ``trainer.async.correction`` modes through the rollout correction: the weight per token
    (1 where the mode has none) and which tokens it capped (clipped or rejected)."""
    c = correct(prox_BT, behav_BT, torch.ones_like(prox_BT), from_async_alias(mode, cap))
    w_BT = torch.ones_like(c.rho_BT) if c.weights_BT is None else c.weights_BT
    return w_BT, {"capped": (c.clipped_BT | c.rejected_BT).float()}


def test_behaviour_weights_clamp_mask_off():
    prox = torch.log(torch.tensor([[0.5, 0.9, 0.2]]))
    behav = torch.log(torch.tensor([[0.5, 0.3, 0.4]]))  # raw weights 1, 3, 0.5
    w, m = behaviour_weights_BT(prox, behav, cap=2.0, mode="clamp")
    assert w.tolist()[0] == pytest.approx([1.0, 2.0, 0.5]) and m["capped"].tolist() == [[0, 1, 0]]
    w, _ = behaviour_weights_BT(prox, behav, cap=2.0, mode="mask")
    assert w.tolist()[0] == pytest.approx([1.0, 0.0, 0.5])
    w, _ = behaviour_weights_BT(prox, behav, mode="off")
    assert w.tolist() == [[1.0, 1.0, 1.0]]
    same, _ = behaviour_weights_BT(prox, prox.clone(), mode="clamp")
    assert torch.equal(same, torch.ones_like(same))  # synchronous: exactly 1
    with pytest.raises(ValueError, match="clamp, mask, off"):
        behaviour_weights_BT(prox, behav, mode="truncate")

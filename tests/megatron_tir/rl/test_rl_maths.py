"""RL maths against numbers computed by hand (in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_tir.rl import (
    LossConfig,
    PolicyLoss,
    aggregate,
    clipped_surrogate_BT,
    group_keep_G,
    grpo_advantages_B,
    kl_k3_BT,
    low_prob_keep_BT,
    reinforce_pp_advantages_BT,
    row_weights,
)

S3 = math.sqrt(1 / 3)  # unbiased std of {1, 0, 0, 1} and of {1, 0, 0}


def t(*x, dtype=torch.float32):
    return torch.tensor(x, dtype=dtype)


def test_grpo_std_normalised_and_not():
    rewards = t(1, 0, 0, 1, 1, 1)
    group = t(0, 0, 0, 0, 1, 1, dtype=torch.long)
    stats = torch.ones(6, dtype=torch.bool)
    # group 0: mean 0.5, std sqrt((4 * 0.25) / 3) -> +-0.5 / 0.57735 = +-0.866; group 1: all equal -> 0
    a = grpo_advantages_B(rewards, group, stats, eps=0.0)
    torch.testing.assert_close(a, t(0.5 / S3, -0.5 / S3, -0.5 / S3, 0.5 / S3, 0, 0))
    a = grpo_advantages_B(rewards, group, stats, std_normalize=False)
    torch.testing.assert_close(a, t(0.5, -0.5, -0.5, 0.5, 0, 0))


def test_grpo_rows_outside_stats_neither_shape_the_group_nor_get_advantage():
    rewards = t(1, 0, 0, 1)
    group = torch.zeros(4, dtype=torch.long)
    stats = t(1, 1, 1, 0, dtype=torch.bool)  # the last row: tool failed
    # {1, 0, 0}: mean 1/3, std sqrt((4/9 + 1/9 + 1/9) / 2) = sqrt(1/3)
    a = grpo_advantages_B(rewards, group, stats, eps=0.0)
    torch.testing.assert_close(a, t((2 / 3) / S3, (-1 / 3) / S3, (-1 / 3) / S3, 0))


def test_void_rows_shape_their_group_and_get_zero_loss_weight():
    """SimpleTIR: advantages over all sampled trajectories, then void rows leave the loss."""
    rewards = t(1, 0, 0, 0)
    group = torch.zeros(4, dtype=torch.long)
    void = t(0, 1, 0, 0, dtype=torch.bool)
    no = torch.zeros(4, dtype=torch.bool)
    stats, loss = row_weights(void_B=void, infra_B=no, truncated_B=no, drop_void=True, overlong="mask")
    assert stats.tolist() == [True] * 4 and loss.tolist() == [True, False, True, True]
    # with the void row: mean 0.25, std sqrt((0.5625 + 3 * 0.0625) / 3) = 0.5 -> A(correct) = 1.5
    a = grpo_advantages_B(rewards, group, stats, eps=0.0)
    torch.testing.assert_close(a, t(1.5, -0.5, -0.5, -0.5))
    # had it been dropped before the statistics: {1, 0, 0} -> A(correct) = (2/3) / sqrt(1/3) = 1.1547
    a_wrong = grpo_advantages_B(rewards, group, ~void, eps=0.0)
    assert a_wrong[0].item() == pytest.approx(1.1547, abs=1e-4)


def test_row_weights_infra_and_overlong():
    void = t(0, 0, 0, 1, dtype=torch.bool)
    infra = t(0, 1, 0, 0, dtype=torch.bool)
    trunc = t(0, 0, 1, 0, dtype=torch.bool)
    stats, loss = row_weights(void_B=void, infra_B=infra, truncated_B=trunc, drop_void=True, overlong="mask")
    assert stats.tolist() == [True, False, True, True]
    assert loss.tolist() == [True, False, False, False]
    stats, loss = row_weights(void_B=void, infra_B=infra, truncated_B=trunc, drop_void=False, overlong="keep")
    assert loss.tolist() == [True, False, True, True]
    stats, loss = row_weights(void_B=void, infra_B=infra, truncated_B=trunc, drop_void=True, overlong="drop")
    assert stats.tolist() == [True, False, False, True] and loss.tolist() == [True, False, False, False]
    with pytest.raises(ValueError, match="overlong"):
        row_weights(void_B=void, infra_B=infra, truncated_B=trunc, drop_void=True, overlong="clip")


def test_reinforce_pp_whitens_returns_over_batch_tokens():
    rewards = t(1, 0)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    stats = torch.ones(2, dtype=torch.bool)
    # gamma 1: returns {1, 1, 0}; mean 2/3, std sqrt((1/9 + 1/9 + 4/9) / 2) = sqrt(1/3)
    a = reinforce_pp_advantages_BT(rewards, mask, stats, eps=0.0)
    torch.testing.assert_close(a, torch.tensor([[(1 / 3) / S3, (1 / 3) / S3, 0], [(-2 / 3) / S3, 0, 0]]))
    # gamma 0.5: returns {0.5, 1, 0}; mean 0.5, std sqrt((0 + 0.25 + 0.25) / 2) = 0.5
    a = reinforce_pp_advantages_BT(rewards, mask, stats, gamma=0.5, eps=0.0)
    torch.testing.assert_close(a, torch.tensor([[0.0, 1.0, 0.0], [-1.0, 0.0, 0.0]]))
    # feedback tokens (mask 0) between model tokens are not steps: returns stay {1, 1}
    mask2 = torch.tensor([[1.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    a = reinforce_pp_advantages_BT(rewards, mask2, stats, gamma=0.5, eps=0.0)
    torch.testing.assert_close(a, torch.tensor([[0.0, 0.0, 1.0], [-1.0, 0.0, 0.0]]))


def test_clipped_surrogate_clip_low_high_and_dual():
    ratio = t(1.5, 0.5, 0.5, 1.5, 4.0, 3.5, 1.0)
    adv = t(1, 1, -1, -1, -1, -2, 0.5)
    old = torch.zeros(7)
    logp = torch.log(ratio).requires_grad_(True)
    loss, m = clipped_surrogate_BT(logp[None], old[None], adv[None], clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    # A=1 rho=1.5: max(-1.5, -1.28) = -1.28 (clip high); A=1 rho=.5: max(-.5, -.8) = -.5;
    # A=-1 rho=.5: max(.5, .8) = .8 (clip low); A=-1 rho=1.5: max(1.5, 1.28) = 1.5;
    # A=-1 rho=4: min(4, 3) = 3 (dual); A=-2 rho=3.5: min(7, 6) = 6 (dual); A=.5 rho=1: -.5
    torch.testing.assert_close(loss[0], t(-1.28, -0.5, 0.8, 1.5, 3.0, 6.0, -0.5))
    assert m["clip_high"][0].tolist() == [1, 0, 0, 0, 0, 0, 0]
    assert m["clip_low"][0].tolist() == [0, 0, 1, 0, 0, 0, 0]
    assert m["dual_clip"][0].tolist() == [0, 0, 0, 0, 1, 1, 0]
    loss.sum().backward()
    # d/dlogp of -A * rho is -A * rho where unclipped; 0 where clipped
    torch.testing.assert_close(logp.grad, t(0, -0.5, 0, 1.5, 0, 0, -0.5))
    loss2, m2 = clipped_surrogate_BT(logp.detach()[None], old[None], adv[None], clip_low=0.2, clip_high=0.28,
                                     dual_clip=None)
    assert loss2[0, 4].item() == pytest.approx(4.0) and m2["dual_clip"].sum() == 0


def test_aggregations_token_mean_and_eq1():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert aggregate(loss, mask, "token_mean").item() == pytest.approx(10 / 4)
    assert aggregate(loss, mask, "seq_mean").item() == pytest.approx((2 + 4) / 2)  # empty row not counted
    with pytest.raises(ValueError):
        aggregate(loss, mask, "sum")


def test_kl_k3_and_entropy_terms():
    logp = torch.log(t(0.5))
    ref = torch.log(t(0.25))
    # d = ln(0.5): 0.5 - ln 0.5 - 1 = 0.19315
    assert kl_k3_BT(logp, ref).item() == pytest.approx(0.5 - math.log(0.5) - 1, abs=1e-6)
    fn = PolicyLoss(LossConfig(kl_coef=0.1, entropy_coef=0.01))
    extras = {"old_logprobs_BT": logp[None], "advantages_BT": t(1.0)[None], "ref_logprobs_BT": ref[None],
              "loss_mask_BT": t(1.0)[None]}
    loss, m = fn(logp[None], t(2.0)[None], extras)
    # -1 (ratio 1, A 1) + 0.1 * 0.19315 - 0.01 * 2
    assert loss.item() == pytest.approx(-1 + 0.1 * 0.193147 - 0.02, abs=1e-5)
    assert set(m) >= {"kl", "entropy", "ratio", "clip_low", "clip_high", "dual_clip"}
    with pytest.raises(ValueError, match="entropy"):
        fn(logp[None], None, extras)


def test_policy_loss_high_ratio_filter_and_max_ratio():
    fn = PolicyLoss(LossConfig(), high_ratio_bound=2.0)
    old = torch.zeros(1, 3)
    logp = torch.log(t(1.0, 2.5, 5.0))[None]
    extras = {"old_logprobs_BT": old, "advantages_BT": t(-1.0, -1.0, -1.0)[None], "loss_mask_BT": t(1, 1, 0)[None]}
    loss, m = fn(logp, None, extras)
    torch.testing.assert_close(loss[0], t(1.0, 0.0, 0.0))  # ratios 2.5 and 5 exceed the bound
    assert m["high_ratio_masked"][0].tolist() == [0, 1, 1]
    assert fn.max_ratio == pytest.approx(2.5)  # the masked-out (loss mask 0) token is not counted


def test_high_ratio_filter_reports_its_kept_tokens_and_drops_every_term():
    """The filtered tokens get no surrogate, KL or entropy term, and ``KEEP_METRIC`` 0 (the learner
    then takes them out of the denominator: tests/megatron_tir/policy/test_learner_keep.py)."""
    from megatron_tir.rl.loss import KEEP_METRIC

    cfg = LossConfig(kl_coef=0.1, entropy_coef=0.02)
    logp = torch.log(t(1.0, 2.5, 1.5))[None]
    extras = {"old_logprobs_BT": torch.zeros(1, 3), "advantages_BT": t(1.0, 1.0, 1.0)[None],
              "ref_logprobs_BT": t(-0.5, -0.5, -0.5)[None]}
    ent = t(0.3, 0.3, 0.3)[None]
    loss, m = PolicyLoss(cfg, high_ratio_bound=2.0)(logp, ent, extras)
    plain, m0 = PolicyLoss(cfg)(logp, ent, extras)
    assert m[KEEP_METRIC][0].tolist() == [1, 0, 1] and KEEP_METRIC not in m0
    assert loss[0, 1] == 0 and plain[0, 1] != 0
    torch.testing.assert_close(loss[0, [0, 2]], plain[0, [0, 2]])


def test_low_prob_keep_masks_each_rows_lowest_tokens():
    lp = torch.tensor([[-1.0, -3.0, -0.5, -2.0, -9.0], [-0.1, -0.2, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0, 0.0]])
    # row 0: 4 tokens, ceil(0.25 * 4) = 1 -> the -3; the -9 is not a loss token
    # row 1: 2 tokens, ceil(0.25 * 2) = 1 -> the -0.2
    keep = low_prob_keep_BT(lp, mask, 0.25)
    assert keep.tolist() == [[1, 0, 1, 1, 1], [1, 0, 1, 1, 1]]
    keep = low_prob_keep_BT(lp, mask, 0.5)
    assert keep[0].tolist() == [1, 0, 1, 0, 1]
    assert low_prob_keep_BT(lp, mask, 0.0).eq(1).all()


def test_group_keep_zero_std_accuracy_and_uncounted():
    rewards = t(1, 1, 1, 0, 0, 0, 1, 0, 1, 0)
    group = t(0, 0, 1, 1, 1, 1, 2, 2, 3, 3, dtype=torch.long)
    stats = t(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, dtype=torch.bool)
    keep, removed = group_keep_G(rewards, group, stats, drop_zero_std=True)
    assert keep.tolist() == [False, True, True, False]
    assert removed == {"no_counted_rows": 1, "zero_std": 1, "accuracy": 0}
    # accuracy of group 1 = 0.25, group 2 = 0.5: bounds [0.3, 1] drop group 1
    keep, removed = group_keep_G(rewards, group, stats, drop_zero_std=True, accuracy_lo=0.3)
    assert keep.tolist() == [False, False, True, False] and removed["accuracy"] == 1
    keep, _ = group_keep_G(rewards, group, stats, drop_zero_std=False)
    assert keep.tolist() == [True, True, True, False]


def test_every_advantage_estimator_has_the_one_signature_and_zero_outside_the_mask():
    from megatron_tir.rl import ADVANTAGE_ESTIMATORS

    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    group = torch.tensor([0, 0, 1, 1])
    stats = torch.tensor([True, True, True, False])
    mask = torch.tensor([[0, 1, 1], [1, 1, 0], [0, 0, 1], [1, 1, 1]], dtype=torch.float32)
    got = {name: fn(rewards, group, stats, mask) for name, fn in ADVANTAGE_ESTIMATORS.items()}
    for name, adv in got.items():
        assert adv.shape == mask.shape, name
        assert bool((adv[mask == 0] == 0).all()) and bool((adv[3] == 0).all()), name  # row 3 is not counted
    # group 0 = {1, 0}: mean 0.5, std sqrt(0.5); group 1's only counted row has advantage 0
    a = 0.5 / (0.5 ** 0.5 + 1e-6)
    torch.testing.assert_close(got["grpo"][:, 1], torch.tensor([a, -a, 0.0, 0.0]))
    torch.testing.assert_close(got["dr_grpo"][:, 1], torch.tensor([0.5, -0.5, 0.0, 0.0]))

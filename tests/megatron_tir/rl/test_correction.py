"""The rollout correction's modes against numpy references of the upstream formulas:

* slime ``slime/backends/megatron_utils/loss.py: vanilla_tis_function`` (``--use-tis --tis-clip
  --tis-clip-low``): ``clamp(exp(old - rollout), min=tis_clip_low, max=tis_clip)``;
* verl ``verl/trainer/ppo/rollout_corr_helper.py``: ``compute_rollout_correction_weights``
  (token / sequence: ``exp(clamp(masked_sum(log_ratio), -20, 20))`` truncated at the threshold),
  ``compute_rollout_rejection_mask`` (token / sequence / geometric: keep ``lower <= w <= upper``,
  lower ``1 / upper`` by default) and ``compute_offpolicy_metrics`` (``k3_kl``);
* slime ``examples/train_infer_mismatch_helper/mis.py`` ``mis_mode=mask``: the weights stay, the
  tokens (rows) outside the bounds leave the loss mask.

The references below are written from those formulas, independently of the module (numpy, float64)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_tir.rl.correction import CORRECTION_MODES, CorrectionConfig, correct, from_async_alias, named_stats

B, T = 5, 9
RNG = np.random.default_rng(7)
ENGINE = np.log(RNG.uniform(0.05, 0.95, (B, T)))
OLD = ENGINE + RNG.choice([-0.9, -0.3, -0.05, 0.0, 0.04, 0.2, 0.8], (B, T))  # learner - engine: both sides of 1
OLD[0, 3] += 0.8  # and far above it
OLD[2, 5] += 1.2
MASK = np.ones((B, T))
MASK[:, :2] = 0  # prompt
MASK[1, 4:6] = 0  # tool output
MASK[3, 6:] = 0  # padding
MASK[4, :] = 0  # a row without loss tokens
OLD[MASK == 0] = 0.0  # the learner's log-probs where the engine reported none (padding, prompt)


def _t(a):
    return torch.tensor(a, dtype=torch.float32)


def _run(mode, **kw):
    return correct(_t(OLD), _t(ENGINE), _t(MASK), CorrectionConfig(mode=mode, **kw))


# --------------------------------------------------------------------- numpy references of the upstream formulas

def slime_tis(old, rollout, tis_clip, tis_clip_low=0.0):
    tis = np.exp(old - rollout)
    return np.clip(tis, tis_clip_low, tis_clip)


def verl_is_weights(log_ratio, mask, level, threshold):
    if level == "token":
        w = np.exp(np.clip(log_ratio, -20, 20))
    else:  # sequence
        w = np.exp(np.clip((log_ratio * mask).sum(-1, keepdims=True), -20, 20)) * np.ones_like(log_ratio)
    return np.minimum(w * mask, threshold)


def verl_rs_mask(log_ratio, mask, level, upper, lower=None):
    lower = 1.0 / upper if lower is None else lower
    if level == "token":
        w = np.exp(np.clip(log_ratio, -20, 20))
    elif level == "sequence":
        w = np.exp(np.clip((log_ratio * mask).sum(-1, keepdims=True), -20, 20)) * np.ones_like(log_ratio)
    else:  # geometric
        mean = (log_ratio * mask).sum(-1, keepdims=True) / np.maximum(mask.sum(-1, keepdims=True), 1)
        w = np.exp(np.clip(mean, -20, 20)) * np.ones_like(log_ratio)
    return mask * ((w >= lower) & (w <= upper)), w


def verl_k3(old, rollout, mask):
    lr = old - rollout
    return ((np.exp(lr) - lr - 1) * mask).sum() / mask.sum()


ON = MASK > 0


def _close(got, want, tol=2e-6):
    np.testing.assert_allclose(got.double().numpy()[ON], np.asarray(want, dtype=np.float64)[ON], rtol=tol, atol=tol)


# --------------------------------------------------------------------- each mode


@pytest.mark.parametrize("high,low", [(2.0, None), (1.5, 0.7)])
def test_tis_is_slimes_truncated_is_and_verls_token_is(high, low):
    c = _run("tis", high=high, low=low)
    _close(c.weights_BT, slime_tis(OLD, ENGINE, high, 0.0 if low is None else low))
    if low is None:  # verl's token IS: upper clip only
        _close(c.weights_BT, verl_is_weights(OLD - ENGINE, MASK, "token", high))
    assert torch.equal(c.loss_mask_BT, _t(MASK))  # nothing rejected
    rho = np.exp(OLD - ENGINE)
    clipped = (rho > high) | (rho < (low or 0.0))
    assert c.clipped_BT.numpy()[ON].tolist() == clipped[ON].tolist()  # slime's tis_clipfrac: weight != tis
    assert c.means["clipped_share"][0] / c.means["clipped_share"][1] == pytest.approx(clipped[ON].mean())


def test_seq_tis_is_verls_sequence_is():
    c = _run("seq_tis", high=2.0)
    _close(c.weights_BT, verl_is_weights(OLD - ENGINE, MASK, "sequence", 2.0))
    assert torch.equal(c.loss_mask_BT, _t(MASK))


@pytest.mark.parametrize("mode,level", [("mis", "token"), ("seq_mis", "sequence"), ("geo_rs", "geometric")])
@pytest.mark.parametrize("high,low", [(2.0, None), (1.3, 0.9), (1.05, 0.0)])
def test_rejection_modes_are_verls_rejection_masks(mode, level, high, low):
    c = _run(mode, high=high, low=low)
    keep, w = verl_rs_mask(OLD - ENGINE, MASK, level, high, low)
    assert c.loss_mask_BT.numpy().tolist() == keep.tolist()
    kept = keep > 0
    if mode == "geo_rs":  # rejection only: no weight
        assert c.weights_BT is None
    else:  # slime mis.py mask mode: the kept tokens carry the (untruncated) weight of their level
        np.testing.assert_allclose(c.weights_BT.double().numpy()[kept], w[kept], rtol=2e-6)
    rejected = ON & ~kept
    assert c.rejected_BT.numpy().tolist() == rejected.tolist()
    s, n = c.means["rejected_share"]
    assert s / n == pytest.approx(rejected[ON].mean())


def test_the_rejection_modes_reject_something_here_and_tis_clips_both_sides():
    """The data exercise the bounds (so the comparisons above are not vacuous)."""
    assert 0 < _run("mis").means["rejected_share"][0] < ON.sum()
    assert 0 < _run("seq_mis", high=1.3).means["rejected_share"][0]
    assert 0 < _run("geo_rs", high=1.05).means["rejected_share"][0]
    c = _run("tis", high=1.5, low=0.7)
    w = c.weights_BT.numpy()[ON]
    assert (w == np.float32(1.5)).any() and (w == np.float32(0.7)).any()


@pytest.mark.parametrize("mode", CORRECTION_MODES)
def test_metrics_every_mode_against_verls_offpolicy_metrics(mode):
    c = _run(mode)
    d = (OLD - ENGINE)[ON]
    mean = {k: s / n for k, (s, n) in c.means.items()}
    assert mean["k3_kl"] == pytest.approx(verl_k3(OLD, ENGINE, MASK), rel=1e-5)
    assert mean["log_ratio_mean"] == pytest.approx(d.mean(), rel=1e-5)
    assert mean["log_ratio_abs_mean"] == pytest.approx(np.abs(d).mean(), rel=1e-5)
    assert c.maxima["log_ratio_abs_max"] == pytest.approx(np.abs(d).max(), rel=1e-5)
    assert c.means["k3_kl"][1] == ON.sum()  # over the model tokens only


def test_per_turn_metrics_split_by_turn():
    turns = np.full((B, T), -1)
    turns[ON] = 0
    turns[:, 6:][ON[:, 6:]] = 1  # the tokens after the tool output are turn 1
    c = correct(_t(OLD), _t(ENGINE), _t(MASK), CorrectionConfig(mode="none"), turn_index_BT=torch.tensor(turns))
    for k in (0, 1):
        m = ON & (turns == k)
        s, n = c.means[f"k3_kl_turn_{k}"]
        assert n == m.sum() and s / n == pytest.approx(verl_k3(OLD, ENGINE, m.astype(float)), rel=1e-5)
        s, n = c.means[f"log_ratio_abs_mean_turn_{k}"]
        assert s / n == pytest.approx(np.abs(OLD - ENGINE)[m].mean(), rel=1e-5)


@pytest.mark.parametrize("mode", CORRECTION_MODES)
def test_identical_logprobs_give_weight_one_and_reject_nothing(mode):
    lp = _t(ENGINE)
    for high, low in [(2.0, None), (1.0, 1.0)]:  # the tightest bounds still keep a weight of exactly 1
        c = correct(lp, lp.clone(), _t(MASK), CorrectionConfig(mode=mode, high=high, low=low))
        if c.weights_BT is not None:
            assert torch.equal(c.weights_BT[_t(MASK) > 0], torch.ones(int(ON.sum())))
        assert torch.equal(c.loss_mask_BT, _t(MASK))
        assert c.means["k3_kl"][0] == 0 and c.maxima["log_ratio_abs_max"] == 0 and c.maxima["weight_max"] == 1
        assert c.means["clipped_share"][0] == c.means["rejected_share"][0] == 0


def test_none_changes_nothing_and_weights_are_detached():
    c = _run("none")
    assert c.weights_BT is None and c.extras() == {"loss_mask_BT": c.loss_mask_BT}
    old = _t(OLD).requires_grad_()
    w = correct(old, _t(ENGINE), _t(MASK), CorrectionConfig(mode="tis")).weights_BT
    assert not w.requires_grad


def test_no_loss_token_no_metrics():
    c = correct(_t(OLD), _t(ENGINE), torch.zeros(B, T), CorrectionConfig(mode="tis"))
    assert c.means == {} and c.maxima == {}


# --------------------------------------------------------------------- the config and the async aliases


def test_config_bounds_and_defaults():
    assert CorrectionConfig(mode="tis").lower == 0.0  # slime's --tis-clip-low default
    assert CorrectionConfig(mode="mis", high=4.0).lower == 0.25  # verl's rollout_rs_threshold_lower default
    assert CorrectionConfig(mode="mis", high=4.0, low=0.5).lower == 0.5
    for kw, message in [({"mode": "icepop"}, "mode must be one of auto, none, tis"), ({"high": 0.5}, "high must be >= 1"),
                        ({"low": 1.5}, r"low must be in \[0, 1\]"), ({"low": -0.1}, r"low must be in \[0, 1\]")]:
        with pytest.raises(ValueError, match=message):
            CorrectionConfig(**kw)


def test_auto_is_none_in_sync_and_the_async_alias_otherwise():
    auto = CorrectionConfig()
    assert auto.resolved("off").mode == "none"
    assert auto.resolved("one_step") == CorrectionConfig(mode="tis", high=2.0, low=0.0)  # the former clamp at 2
    assert auto.resolved("full", "mask", 3.0) == CorrectionConfig(mode="mis", high=3.0, low=0.0)
    assert auto.resolved("full", "off", 2.0).mode == "none"
    explicit = CorrectionConfig(mode="seq_mis", high=3.0)
    assert explicit.resolved("one_step", "mask", 5.0) is explicit
    assert from_async_alias("clamp", 2.0) == CorrectionConfig(mode="tis", high=2.0, low=0.0)


def test_named_stats_keep_the_former_async_metric_names():
    c = _run("mis", high=2.0, low=0.0)  # the former mask at cap 2
    means, maxima = named_stats(c, legacy=True)
    assert means["offpolicy/kl"] == means["correction/k3_kl"] == c.means["k3_kl"]
    assert means["offpolicy/abs_dlogp_mean"] == c.means["log_ratio_abs_mean"]
    assert means["offpolicy/capped_share"][0] == c.means["rejected_share"][0] + c.means["clipped_share"][0]
    assert maxima["offpolicy/weight_max"] == maxima["correction/weight_max"]
    means, maxima = named_stats(c)
    assert not any(k.startswith("offpolicy/") for k in [*means, *maxima])


def test_k3_of_a_float_rounding_gap_is_its_second_order_term_not_a_negative_number():
    """A learner and an engine that agree to 1e-6 (the local engine here): k3 = rho - d - 1 ~ d^2 / 2, which
    float32 ``exp(d) - d - 1`` rounds to 0 or below (it reported -4.9e-10 on a smollm2-cpu step)."""
    engine = _t(ENGINE)
    d = torch.tensor([[1e-6, -2e-6, 3e-6, 0.0] + [1e-6] * (T - 4)] * B)
    c = correct(engine + d, engine, _t(MASK), CorrectionConfig(mode="none"))
    got = (engine + d - engine).double()[_t(MASK) > 0]  # the float32 differences the module sees
    s, n = c.means["k3_kl"]
    assert s / n == pytest.approx(float((got ** 2 / 2).mean()), rel=1e-3) and s > 0

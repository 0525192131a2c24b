"""The rollout correction's token veto, IS batch normalisation and off-policy diagnostics (verl
``verl/trainer/ppo/rollout_corr_helper.py``: ``compute_rollout_correction_and_rejection_mask`` step 4,
``compute_rollout_correction_weights`` with ``rollout_is_batch_normalize``, ``compute_offpolicy_metrics``)
on a crafted batch whose every expected number is worked out by hand in the comments.

The batch (engine log-prob ln 0.2 on every loss token; ``rho = exp(learner - engine)``)::

    row 0: rho = 2, 1, 0.5        (3 loss tokens)      prod 1
    row 1: rho = 1, 0.01, 1, 4    (4 loss tokens)      prod 0.04   <- a catastrophic token (0.01)
    row 2: rho = 1.5, 1.5         (2 loss tokens)      prod 2.25
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_tir.policy.parallel import run_ranks
from megatron_tir.rl.correction import CORRECTION_MODES, CorrectionConfig, correct, named_stats
from megatron_tir.train.config import apply_overrides
from megatron_tir.train.recipes import load_recipe

ENGINE_LP = math.log(0.2)
RHO = [[2.0, 1.0, 0.5, None], [1.0, 0.01, 1.0, 4.0], [None, 1.5, 1.5, None]]  # None: not a loss token


def _batch(rho=RHO):
    mask = torch.tensor([[0.0 if r is None else 1.0 for r in row] for row in rho])
    engine = torch.full(mask.shape, ENGINE_LP, dtype=torch.float64)
    old = engine + torch.tensor([[0.0 if r is None else math.log(r) for r in row] for row in rho], dtype=torch.float64)
    engine[mask == 0], old[mask == 0] = 0.0, -100.0  # what is not a loss token is never read: garbage there
    return old.float(), engine.float(), mask


def _run(mode, rho=RHO, **kw):
    old, engine, mask = _batch(rho)
    return correct(old, engine, mask, CorrectionConfig(mode=mode, **kw))


def _mean(c, name):
    s, n = c.means[name]
    return s / n


# --------------------------------------------------------------------- token veto

@pytest.mark.parametrize("mode", CORRECTION_MODES)
def test_the_veto_takes_the_row_with_a_catastrophic_token_out_in_every_mode(mode):
    off, on = _run(mode), _run(mode, token_veto=0.1)
    assert off.means["veto_share"] == (0.0, 3.0)
    if mode in ("none", "tis", "seq_tis"):  # nothing else takes row 1 out (seq_mis and geo_rs reject it too)
        assert off.loss_mask_BT[1].tolist() == [1.0] * 4
    assert on.loss_mask_BT[1].tolist() == [0.0] * 4  # row 1 (rho 0.01 < 0.1) leaves the loss entirely
    assert on.rejected_BT[1].tolist() == [True] * 4 and not on.clipped_BT[1].any()
    assert on.means["veto_share"] == (1.0, 3.0)  # 1 of the 3 rows with loss tokens
    if on.weights_BT is not None:
        assert on.weights_BT[1].tolist() == [0.0] * 4
    assert torch.equal(on.loss_mask_BT[[0, 2]], off.loss_mask_BT[[0, 2]])  # the other rows as the mode left them
    s, n = on.means["rejected_share"]
    assert n == 9 and s >= 4


def test_the_veto_compares_strictly_below_the_threshold_on_the_unclamped_log_ratio():
    assert _run("none", token_veto=0.005).means["veto_share"] == (0.0, 3.0)  # the smallest rho is 0.01
    assert _run("none", token_veto=1.0).means["veto_share"] == (2.0, 3.0)  # rows 0 (0.5) and 1 (0.01); row 2 >= 1
    far = [[1.0, math.exp(-25.0)], [1.0, math.exp(-19.0)]]  # d = -25 clamps to -20 (e^-20 > 1e-10), verl vetoes it
    c = _run("tis", far, token_veto=1e-10)  # log(1e-10) = -23.03: row 0's -25 is below, row 1's -19 is not
    assert c.loss_mask_BT.tolist() == [[0.0, 0.0], [1.0, 1.0]] and c.means["veto_share"] == (1.0, 2.0)


def test_no_veto_leaves_tis_as_it_was():
    c = _run("tis", high=2.0)  # row 1: 1, 0.01, 1, 4 -> 4 clipped to 2
    assert c.loss_mask_BT[1].tolist() == [1.0] * 4
    assert c.weights_BT[1].tolist() == pytest.approx([1.0, 0.01, 1.0, 2.0], rel=1e-5)
    assert c.means["veto_share"] == (0.0, 3.0)


# --------------------------------------------------------------------- batch normalisation

def test_token_level_batch_normalisation_divides_by_the_mean_over_the_kept_tokens():
    c = _run("tis", high=2.0, batch_normalize=True)
    # clipped weights 2 1 .5 | 1 .01 1 2 | 1.5 1.5: sum 10.51 over 9 tokens
    factor = (2 + 1 + 0.5 + 1 + 0.01 + 1 + 2 + 1.5 + 1.5) / 9
    assert c.maxima["batch_norm_factor"] == pytest.approx(factor, rel=1e-5)
    assert c.weights_BT[0, :3].tolist() == pytest.approx([2 / factor, 1 / factor, 0.5 / factor], rel=1e-5)
    assert c.weights_BT[1].tolist() == pytest.approx([1 / factor, 0.01 / factor, 1 / factor, 2 / factor], rel=1e-5)
    assert _mean(c, "weight_mean") == pytest.approx(1.0, abs=1e-6)
    vetoed = _run("tis", high=2.0, batch_normalize=True, token_veto=0.1)  # row 1 out: 2 1 .5 1.5 1.5 = 6.5 over 5
    assert vetoed.maxima["batch_norm_factor"] == pytest.approx(1.3, rel=1e-5)
    assert vetoed.weights_BT[2, 1:3].tolist() == pytest.approx([1.5 / 1.3] * 2, rel=1e-5)
    assert _mean(vetoed, "weight_mean") == pytest.approx(1.0, abs=1e-6)


def test_sequence_level_batch_normalisation_divides_by_the_mean_over_the_rows():
    c = _run("seq_tis", high=2.0, batch_normalize=True)
    factor = (1.0 + 0.04 + 2.0) / 3  # row weights prod rho: 1, 0.04, 2.25 -> clipped to 2; one per row
    assert c.maxima["batch_norm_factor"] == pytest.approx(factor, rel=1e-5)
    assert c.weights_BT[0, :3].tolist() == pytest.approx([1 / factor] * 3, rel=1e-5)
    assert c.weights_BT[1].tolist() == pytest.approx([0.04 / factor] * 4, rel=1e-5)
    assert c.weights_BT[2, 1:3].tolist() == pytest.approx([2 / factor] * 2, rel=1e-5)
    vetoed = _run("seq_tis", high=2.0, batch_normalize=True, token_veto=0.1)  # rows 0 and 2: (1 + 2) / 2
    assert vetoed.maxima["batch_norm_factor"] == pytest.approx(1.5, rel=1e-5)
    assert vetoed.weights_BT[2, 1:3].tolist() == pytest.approx([2 / 1.5] * 2, rel=1e-5)


def test_without_batch_normalisation_no_factor():
    assert "batch_norm_factor" not in _run("tis").maxima


# --------------------------------------------------------------------- chi-square and perplexities

@pytest.mark.parametrize("mode", CORRECTION_MODES)
def test_chi_square_and_perplexities_by_hand(mode):
    c = _run(mode, token_veto=0.1)  # over the loss tokens before rejection or veto, whatever the mode
    rho2 = [4, 1, 0.25, 1, 1e-4, 1, 16, 2.25, 2.25]
    assert _mean(c, "chi2_token") == pytest.approx(sum(rho2) / 9 - 1, rel=1e-5)  # E[rho^2] - 1 = 2.08334
    assert c.means["chi2_token"][1] == 9
    assert _mean(c, "chi2_seq") == pytest.approx(((1 - 1) + (0.04 ** 2 - 1) + (2.25 ** 2 - 1)) / 3, rel=1e-5)
    assert c.means["chi2_seq"][1] == 3  # rows with loss tokens
    # engine: log-prob ln 0.2 on every token -> perplexity 5 on every row; learner: 5 / (prod rho)^(1 / n)
    assert _mean(c, "engine_ppl") == pytest.approx(5.0, rel=1e-5)
    assert _mean(c, "learner_ppl") == pytest.approx((5 + 5 / 0.04 ** 0.25 + 5 / 2.25 ** 0.5) / 3, rel=1e-5)
    # per row mean engine - mean learner = -mean d: 0, -ln(0.04) / 4, -ln(2.25) / 2
    assert _mean(c, "log_ppl_diff") == pytest.approx((0 - math.log(0.04) / 4 - math.log(2.25) / 2) / 3, rel=1e-5)


def test_chi2_seq_clamps_the_row_log_ratio_at_the_safety_bound():
    c = _run("none", [[math.exp(8.0)] * 3])  # S = 24 -> 20: exp(40) - 1
    assert _mean(c, "chi2_seq") == pytest.approx(math.expm1(40.0), rel=1e-5)


def test_the_new_metrics_are_named_and_add_up_over_replicas():
    means, maxima = named_stats(_run("tis", batch_normalize=True, token_veto=0.1))
    for name in ("chi2_token", "chi2_seq", "engine_ppl", "learner_ppl", "log_ppl_diff", "veto_share"):
        assert len(means[f"correction/{name}"]) == 2  # (sum, count)
    assert "correction/batch_norm_factor" in maxima
    # two replicas' halves add up to the whole batch's means
    old, engine, mask = _batch()
    halves = [correct(old[s], engine[s], mask[s], CorrectionConfig(mode="none")) for s in (slice(0, 1), slice(1, 3))]
    whole = _run("none")
    for name in ("chi2_token", "chi2_seq", "engine_ppl", "learner_ppl", "log_ppl_diff", "veto_share"):
        s = sum(h.means[name][0] for h in halves)
        n = sum(h.means[name][1] for h in halves)
        assert (s, n) == pytest.approx(whole.means[name], rel=1e-9)


# --------------------------------------------------------------------- identical log-probs

@pytest.mark.parametrize("mode,normalize", [(m, False) for m in CORRECTION_MODES] + [("tis", True), ("seq_tis", True)])
def test_identical_logprobs_veto_nothing_chi2_zero_and_normalised_weights_exactly_one(mode, normalize):
    _, engine, mask = _batch()
    c = correct(engine, engine.clone(), mask, CorrectionConfig(mode=mode, token_veto=1.0, batch_normalize=normalize))
    assert torch.equal(c.loss_mask_BT, mask) and c.means["veto_share"] == (0.0, 3.0)
    assert c.means["chi2_token"][0] == 0.0 and c.means["chi2_seq"][0] == 0.0 and c.means["log_ppl_diff"][0] == 0.0
    assert c.means["engine_ppl"] == c.means["learner_ppl"]
    if c.weights_BT is not None:
        assert torch.equal(c.weights_BT[mask > 0], torch.ones(int(mask.sum())))
    if normalize:
        assert c.maxima["batch_norm_factor"] == 1.0


# --------------------------------------------------------------------- the config

@pytest.mark.parametrize("kw,message", [({"token_veto": 0.0}, "token_veto must be in"),
                                        ({"token_veto": -0.5}, "token_veto must be in"),
                                        ({"token_veto": 1.5}, "token_veto must be in"),
                                        ({"mode": "mis", "batch_normalize": True}, "batch_normalize needs mode"),
                                        ({"batch_normalize": True}, "batch_normalize needs mode")])  # auto
def test_config_refuses_bad_settings(kw, message):
    with pytest.raises(ValueError, match=message):
        CorrectionConfig(**kw)


def test_config_file_settings_and_auto_keeps_the_veto():
    with pytest.raises(ValueError, match="token_veto"):
        apply_overrides(load_recipe("tiny-cpu"), ["trainer.correction.token_veto=2.0"])
    cfg = apply_overrides(load_recipe("tiny-cpu"), ["trainer.correction.mode=seq_tis",
                                                    "trainer.correction.batch_normalize=true",
                                                    "trainer.correction.token_veto=0.001"])
    assert (cfg.trainer.correction.batch_normalize, cfg.trainer.correction.token_veto) == (True, 0.001)
    auto = CorrectionConfig(token_veto=0.1)
    assert auto.resolved("off") == CorrectionConfig(mode="none", token_veto=0.1)
    assert auto.resolved("one_step") == CorrectionConfig(mode="tis", high=2.0, low=0.0, token_veto=0.1)


# --------------------------------------------------------------------- two data-parallel replicas

def _normalise_rank(rank: int, world: int, out: str) -> None:
    from megatron_tir.policy.parallel import init_parallel

    init_parallel(1, 1, timeout_s=60.0)  # world 2: two data-parallel replicas
    old, engine, mask = _batch()
    rows = slice(0, 2) if rank == 0 else slice(2, 3)  # replica 0: rows 0 and 1 (1 vetoed), replica 1: row 2
    c = correct(old[rows], engine[rows], mask[rows], CorrectionConfig(mode="tis", batch_normalize=True, token_veto=0.1),
                local_rows=True)
    torch.save({"weights": c.weights_BT, "factor": c.maxima["batch_norm_factor"]}, f"{out}/rank{rank}.pt")


@pytest.mark.slow
def test_batch_normalisation_sums_over_the_data_parallel_replicas(tmp_path):
    run_ranks(_normalise_rank, 2, str(tmp_path))
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    # the whole batch's kept tokens 2 1 .5 | 1.5 1.5: 6.5 / 5 = 1.3 on both (per replica: 3.5 / 3 and 1.5)
    assert got[0]["factor"] == pytest.approx(1.3, rel=1e-5) and got[1]["factor"] == pytest.approx(1.3, rel=1e-5)
    assert got[0]["weights"][0, :3].tolist() == pytest.approx([2 / 1.3, 1 / 1.3, 0.5 / 1.3], rel=1e-5)
    assert got[1]["weights"][0, 1:3].tolist() == pytest.approx([1.5 / 1.3] * 2, rel=1e-5)

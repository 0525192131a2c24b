"""The decoupled objective in the policy loss: hand-computed losses for a batch with known
behaviour (engine), proximal (learner recompute) and current log-probs, clamp and mask; the
synchronous loss untouched (no weight, weight exactly 1 with behaviour = proximal, correction off). The
correction is megatron_tir.rl.correction's, applied to the batch as the algorithm applies it
(``train/algorithm.py``), the former ``trainer.async.correction`` spelling through ``from_async_alias``."""

import dataclasses
import math

import pytest
import torch

from megatron_tir.policy.learner_contract import TrainBatch
from megatron_tir.rl import LossConfig, PolicyLoss, aggregate
from megatron_tir.rl.correction import correct, from_async_alias, named_stats

# one row: a prompt token (no loss), then three loss tokens; A = +1 everywhere
# token 1: w = 1,   ratio 1.0               -> -1
# token 2: w = 3,   ratio 1.1 (inside clip) -> -1.1   (clamp: x2; mask: out of the loss)
# token 3: w = 0.5, ratio 1.5 (clip 1.28)   -> -1.28  (x0.5)
PROX = torch.log(torch.tensor([[0.7, 0.5, 0.9, 0.2]]))
BEHAV = torch.log(torch.tensor([[0.1, 0.5, 0.3, 0.4]]))
CUR = torch.log(torch.tensor([[0.7, 0.5, 0.9 * 1.1, 0.2 * 1.5]]))
MASK = torch.tensor([[0.0, 1.0, 1.0, 1.0]])


def _batch(prox=PROX) -> TrainBatch:
    return TrainBatch(tokens_BT=torch.zeros(1, 4, dtype=torch.long), attention_mask_BT=torch.ones(1, 4),
                      loss_mask_BT=MASK.clone(),
                      extras={"old_logprobs_BT": prox.clone(), "advantages_BT": torch.ones(1, 4),
                              "loss_mask_BT": MASK.clone()})


def with_behaviour_weights(batch: TrainBatch, behav_BT: torch.Tensor, *, cap: float,
                           mode: str) -> tuple[TrainBatch, dict[str, float]]:
    """The batch corrected as the algorithm does and the former ``offpolicy/*`` metrics (means and maxima)."""
    c = correct(batch.extras["old_logprobs_BT"], behav_BT, batch.loss_mask_BT, from_async_alias(mode, cap))
    batch = dataclasses.replace(batch, loss_mask_BT=c.loss_mask_BT, extras=batch.extras | c.extras())
    means, maxima = named_stats(c, legacy=True)
    stats = {k.removeprefix("offpolicy/"): s / n for k, (s, n) in means.items() if k.startswith("offpolicy/")}
    return batch, stats | {k.removeprefix("offpolicy/"): v for k, v in maxima.items() if k.startswith("offpolicy/")}


def _loss(batch: TrainBatch, aggregation="token_mean") -> torch.Tensor:
    loss_BT, _ = PolicyLoss(LossConfig(aggregation=aggregation))(CUR, None, batch.extras)
    return aggregate(loss_BT, batch.loss_mask_BT, aggregation)


def test_clamp_by_hand():
    batch, stats = with_behaviour_weights(_batch(), BEHAV, cap=2.0, mode="clamp")
    assert batch.loss_mask_BT.tolist() == MASK.tolist()
    assert _loss(batch).item() == pytest.approx((-1 - 2 * 1.1 - 0.5 * 1.28) / 3, rel=1e-5)
    assert stats["weight_mean"] == pytest.approx((1 + 2 + 0.5) / 3, rel=1e-5)
    assert stats["weight_max"] == pytest.approx(3.0, rel=1e-5)
    assert stats["capped_share"] == pytest.approx(1 / 3)
    assert stats["abs_dlogp_mean"] == pytest.approx((0 + math.log(3) + math.log(2)) / 3, rel=1e-5)
    k3 = [0.0, 3 - math.log(3) - 1, 0.5 - math.log(0.5) - 1]  # w - log w - 1 per token
    assert stats["kl"] == pytest.approx(sum(k3) / 3, rel=1e-5)


def test_mask_by_hand_removes_the_token_from_the_denominator():
    batch, stats = with_behaviour_weights(_batch(), BEHAV, cap=2.0, mode="mask")
    assert batch.loss_mask_BT.tolist() == [[0.0, 1.0, 0.0, 1.0]]
    assert batch.extras["loss_mask_BT"].tolist() == [[0.0, 1.0, 0.0, 1.0]]
    assert _loss(batch).item() == pytest.approx((-1 - 0.5 * 1.28) / 2, rel=1e-5)
    assert _loss(batch, "seq_mean").item() == pytest.approx((-1 - 0.5 * 1.28) / 2, rel=1e-5)
    assert stats["weight_mean"] == pytest.approx((1 + 0.5) / 2, rel=1e-5) and stats["capped_share"] == pytest.approx(1 / 3)


def test_correction_off_and_synchronous_weights_leave_the_loss_bit_identical():
    plain = _loss(_batch())
    assert plain.item() == pytest.approx((-1 - 1.1 - 1.28) / 3, rel=1e-5)  # today's loss, by hand
    off, stats = with_behaviour_weights(_batch(), BEHAV, cap=2.0, mode="off")
    assert torch.equal(_loss(off), plain) and stats["weight_mean"] == 1.0
    sync, stats = with_behaviour_weights(_batch(), PROX.clone(), cap=2.0, mode="clamp")  # behaviour = proximal
    assert torch.equal(sync.extras["behaviour_weights_BT"], torch.ones(1, 4))
    assert torch.equal(_loss(sync), plain)
    assert stats["weight_max"] == 1.0 and stats["capped_share"] == 0.0 and stats["kl"] == 0.0


def test_the_weight_uses_the_given_behaviour_logprobs_not_the_proximal_ones():
    """The ratio is against ``old_logprobs_BT`` (proximal); the weight against the engine's: swapping them changes the loss."""
    batch, _ = with_behaviour_weights(_batch(), BEHAV, cap=2.0, mode="clamp")
    assert not torch.allclose(_loss(batch), _loss(_batch()))
    assert torch.equal(batch.extras["old_logprobs_BT"], PROX)  # the ratio's reference stays the proximal policy

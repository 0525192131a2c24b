"""``trainer.loss.denominator=response_tokens`` (ZeroTIR's script) and
``trainer.loss.aggregation=microbatch_token_mean`` (SimpleTIR's fork) through a real Learner step:
the loss it reports equals the upstream formula on the per-token losses at the current weights.

* yyht/openrlhf_async_pipline 63b6159 ``openrlhf/models/loss.py`` ``PolicyLoss`` with
  ``length_status``: ``masked_sum(loss, action_mask, env_mask, dim=-1).sum() /
  length_status["response_length"]``, the response length being ``action_mask.sum(-1)`` (every
  response token, the tool's output included; ``experience_maker.py``), summed over the optimizer
  step's micro-batches and ranks (``ppo_trainer.py`` ``--use_prefetch``).
* ltzheng/SimpleTIR e7b5b44 ``verl/workers/actor/dp_actor.py`` ``update_policy``: ``pg_loss`` is the
  micro-batch's ``masked_mean``; under ``use_dynamic_bsz`` ``loss = policy_loss * (len(data) /
  ppo_mini_batch_size)``, ``ppo_mini_batch_size`` being the mini-batch's rows per rank (so over
  every rank: each micro-batch's token mean times its rows over the mini-batch's rows).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_tir.policy.learner_config import LearnerConfig
from megatron_tir.policy.learner_contract import TrainBatch
from megatron_tir.policy.losses import TokenLoss
from megatron_tir.rl.loss import SCALE_EXTRA, LossConfig, PolicyLoss, aggregate
from megatron_tir.train.loss_scale import add_loss_scales, response_tokens_B

# (prompt tokens, response segments: +n model tokens, -n tool-output tokens)
ROWS = [(3, [4, -3, 3]), (2, [6]), (4, [2, -2, 2, -4, 3]), (1, [3, -5, 2])]


def _batch(seed: int = 0) -> tuple[TrainBatch, list[int]]:
    """Right-padded rows in log-prob columns (column t scores token t + 1) and each row's response length."""
    T = max(p + sum(map(abs, segs)) for p, segs in ROWS)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 49152, (len(ROWS), T), generator=g)
    attn = torch.zeros(len(ROWS), T, dtype=torch.bool)
    mask = torch.zeros(len(ROWS), T)
    lengths = []
    for b, (p, segs) in enumerate(ROWS):
        n = sum(map(abs, segs))
        attn[b, :p + n] = True
        col = p - 1
        for s in segs:
            if s > 0:
                mask[b, col:col + s] = 1.0
            col += abs(s)
        lengths.append(n)
    tokens[~attn] = 0
    return TrainBatch(tokens_BT=tokens, attention_mask_BT=attn, loss_mask_BT=mask, extras={}), lengths


def _learner(max_tokens: int):
    from megatron_tir.policy.learner import Learner

    return Learner(LearnerConfig(model="tiny-qwen2", lr=1e-4, grad_clip=1e6, max_tokens_per_microbatch=max_tokens))


@pytest.fixture(scope="module")
def learners(parallel_1x1):
    return {"one": _learner(10_000), "per_row": _learner(1), "some": _learner(24)}


def _step(learner, batch: TrainBatch, cfg: LossConfig, extras: dict):
    """One step's result and gradients (DDP's main grads); the weights are put back."""
    params = dict(learner.module.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    update = SimpleNamespace(batch=TrainBatch(tokens_BT=batch.tokens_BT, attention_mask_BT=batch.attention_mask_BT,
                                              loss_mask_BT=batch.loss_mask_BT,
                                              extras=extras | {"loss_mask_BT": batch.loss_mask_BT}),
                             mini_batch_B=torch.zeros(batch.tokens_BT.shape[0], dtype=torch.long))
    add_loss_scales(update, batch.loss_mask_BT, cfg, mini_batches=1)
    result = learner.train_step(update.batch, TokenLoss(token_loss=PolicyLoss(cfg), with_entropy=True),
                                aggregation=cfg.learner_aggregation)
    grads = {n: p.main_grad.detach().clone() for n, p in params.items()}
    for n, p in params.items():
        p.data.copy_(before[n])
    return result, grads, update.batch.extras


def _case(learner, seed: int = 3):
    batch, lengths = _batch(seed)
    lp, ent = learner.logprobs(batch.tokens_BT, batch.attention_mask_BT, with_entropy=True)
    g = torch.Generator().manual_seed(seed)
    extras = {"old_logprobs_BT": lp - 0.2 * torch.rand(lp.shape, generator=g),
              "advantages_BT": torch.randn(lp.shape, generator=g)}
    # the per-token loss at the current weights (entropy term on), unscaled
    loss_BT, _ = PolicyLoss(LossConfig(entropy_coef=0.01))(lp, ent, extras)
    return batch, lengths, extras, loss_BT


def test_response_tokens_are_the_scripts_response_length():
    batch, lengths = _batch()
    assert response_tokens_B(batch.loss_mask_BT, batch.attention_mask_BT).tolist() == lengths
    assert lengths == [10, 6, 13, 10] and batch.loss_mask_BT.sum().item() == 7 + 6 + 7 + 5


def test_response_denominator_is_the_scripts(learners):
    learner = learners["some"]
    batch, lengths, extras, loss_BT = _case(learner)
    m = batch.loss_mask_BT
    want = float((loss_BT * m).sum() / sum(lengths))  # masked_sum(loss, env_mask).sum() / response_length
    cfg = LossConfig(entropy_coef=0.01, denominator="response_tokens")
    r, _, ex = _step(learner, batch, cfg, extras)
    assert ex[SCALE_EXTRA].tolist() == pytest.approx([float(m.sum()) / sum(lengths)] * 4)
    assert r.loss == pytest.approx(want, rel=1e-5)
    plain, _, _ = _step(learner, batch, LossConfig(entropy_coef=0.01), extras)  # today's: the model tokens
    assert plain.loss == pytest.approx(float(aggregate(loss_BT, m, "token_mean")), rel=1e-5)
    assert abs(plain.loss - r.loss) > 1e-3 * abs(plain.loss)


@pytest.mark.parametrize("which", ["one", "per_row", "some"])
def test_microbatch_token_mean_is_the_forks(learners, which):
    learner = learners[which]
    batch, _, extras, loss_BT = _case(learner)
    m = batch.loss_mask_BT
    split = [mb.rows for mb in learner._micro_batches(batch.attention_mask_BT.bool())]
    assert len(split) == {"one": 1, "per_row": 4, "some": 3}[which], split
    rows = m.shape[0]
    want = sum(len(mb) / rows * float((loss_BT[mb] * m[mb]).sum() / m[mb].sum()) for mb in split)
    cfg = LossConfig(entropy_coef=0.01, aggregation="microbatch_token_mean")
    r, grads, _ = _step(learner, batch, cfg, extras)
    assert r.loss == pytest.approx(want, rel=1e-5)
    if which == "one":  # one micro-batch: the token mean
        assert r.loss == pytest.approx(float(aggregate(loss_BT, m, "token_mean")), rel=1e-5)
    if which == "per_row":  # a micro-batch per row: each row's mean, averaged -- seq_mean, gradients too
        seq, seq_grads, _ = _step(learner, batch, LossConfig(entropy_coef=0.01, aggregation="seq_mean"), extras)
        assert r.loss == pytest.approx(seq.loss, rel=1e-5)
        scale = max(g.abs().max().item() for g in seq_grads.values())
        assert max((grads[n] - seq_grads[n]).abs().max().item() for n in grads) <= 1e-5 * scale


def test_settings_are_checked():
    with pytest.raises(ValueError, match="denominator"):
        LossConfig(denominator="tokens")
    with pytest.raises(ValueError, match="needs aggregation=token_mean"):
        LossConfig(denominator="response_tokens", aggregation="seq_mean")
    assert LossConfig().learner_aggregation == "token_mean" and not LossConfig().scaled
    assert LossConfig(aggregation="microbatch_token_mean").learner_aggregation == "token_mean"
    with pytest.raises(ValueError, match="loss_scale_B"):
        PolicyLoss(LossConfig(denominator="response_tokens"))(torch.zeros(1, 2), None, {
            "old_logprobs_BT": torch.zeros(1, 2), "advantages_BT": torch.ones(1, 2)})

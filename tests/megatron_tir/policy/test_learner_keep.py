"""Tokens a loss drops in the forward pass (``KEEP_METRIC``: the high-ratio filter) leave the
aggregation's denominator: the step equals the step with the same tokens out of the loss mask
from the start (the low-prob filter's way), for both aggregations and 1 or 4 micro-batches."""

from __future__ import annotations

import pytest
import torch
from learner_testing import make_batch

from megatron_tir.policy.learner_config import LearnerConfig

from megatron_tir.policy.learner_contract import KEEP_METRIC, TrainBatch
from megatron_tir.policy.losses import TokenLoss
from megatron_tir.policy.parallel import run_ranks
from megatron_tir.rl.loss import LossConfig, PolicyLoss, aggregate

BOUND = 5.0


def _learner(max_tokens: int, tp: int = 1, pp: int = 1):
    from megatron_tir.policy.learner import Learner

    # clipping far above the grad norm: the raw gradients are compared (a clipped pair would hide a scale)
    return Learner(LearnerConfig(model="tiny-qwen2", tp=tp, pp=pp, lr=1e-4, grad_clip=1e6,
                                 max_tokens_per_microbatch=max_tokens))


def _losses(aggregation: str) -> tuple[PolicyLoss, PolicyLoss]:
    """The high-ratio filter and the same loss without it (KL and entropy terms on)."""
    cfg = LossConfig(kl_coef=0.05, entropy_coef=0.01, aggregation=aggregation)
    return PolicyLoss(cfg, high_ratio_bound=BOUND), PolicyLoss(cfg)


@pytest.fixture(scope="module")
def learners(parallel_1x1):
    return {1: _learner(10_000), 4: _learner(16)}


def _case(learner, seed: int = 5):
    """A batch, its log-probs and entropy under the current weights, and the tokens to drop: two of
    row 0, every loss token of row 2 (a whole row leaves seq_mean's row count), one of row 3.
    Their old log-probs are 2 below the current ones (ratio e^2 > BOUND); elsewhere the ratio is 1."""
    b = make_batch(seed)
    lp, ent = learner.logprobs(b.tokens_BT, b.attention_mask_BT, with_entropy=True)
    m = b.loss_mask_BT
    drop = torch.zeros_like(m, dtype=torch.bool)
    for row, picks in ((0, [0, 3]), (2, None), (3, [1])):
        idx = m[row].nonzero().flatten()
        drop[row, idx if picks is None else idx[picks]] = True
    g = torch.Generator().manual_seed(seed)
    extras = {"old_logprobs_BT": lp - 2.0 * drop, "advantages_BT": torch.randn(m.shape, generator=g),
              "ref_logprobs_BT": lp - 0.3 * torch.rand(m.shape, generator=g)}
    return b, lp, ent, drop, extras


def _step(learner, batch, loss_mask_BT, extras, token_loss, aggregation):
    """One step's result and gradients (DDP's main grads); the weights are put back."""
    params = dict(learner.module.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    mb = TrainBatch(tokens_BT=batch.tokens_BT, attention_mask_BT=batch.attention_mask_BT, loss_mask_BT=loss_mask_BT,
                    extras=extras | {"loss_mask_BT": loss_mask_BT})
    result = learner.train_step(mb, TokenLoss(token_loss=token_loss, with_entropy=True), aggregation=aggregation)
    grads = {n: p.main_grad.detach().clone() for n, p in params.items()}
    for n, p in params.items():
        p.data.copy_(before[n])
    return result, grads


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_high_ratio_filter_equals_the_tokens_out_of_the_mask(learners, aggregation):
    filtered, plain = _losses(aggregation)
    batch, lp, ent, drop, extras = _case(learners[1])
    m = batch.loss_mask_BT
    kept_mask = m * ~drop
    k, n = int((drop * m).sum()), int(m.sum())
    assert 0 < k < n and kept_mask[2].sum() == 0 and kept_mask.sum(1).gt(0).sum() == 3
    # hand reference: the per-token loss at the current weights, aggregated over the kept tokens only
    loss_BT, _ = plain(lp, ent, extras)
    want = float(aggregate(loss_BT, kept_mask, aggregation))
    runs = {}
    for n_mb, learner in learners.items():
        assert len(learner._micro_batches(batch.attention_mask_BT)) == n_mb
        runs[n_mb, "filtered"] = _step(learner, batch, m, extras, filtered, aggregation)
        runs[n_mb, "masked"] = _step(learner, batch, kept_mask, extras, plain, aggregation)
    r0, g0 = runs[1, "masked"]
    scale = max(g.abs().max().item() for g in g0.values())
    assert scale > 0 and abs(r0.loss - want) <= 1e-5 * abs(want), (r0.loss, want)
    for key, (r, g) in runs.items():
        print(f"{aggregation} {key}: loss {r.loss:.6f} (hand {want:.6f}), grad norm {r.grad_norm:.6f}")
        assert not r.skipped and abs(r.loss - want) <= 1e-5 * abs(want), (key, r.loss, want)
        assert abs(r.grad_norm - r0.grad_norm) <= 1e-5 * r0.grad_norm, (key, r.grad_norm, r0.grad_norm)
        assert max((g[name] - g0[name]).abs().max().item() for name in g0) <= 1e-5 * scale, key
    share = runs[1, "filtered"][0].metrics
    if aggregation == "token_mean":  # metrics keep the unfiltered weights: the kept and the dropped shares
        assert share[KEEP_METRIC] == pytest.approx(1 - k / n) and share["high_ratio_masked"] == pytest.approx(k / n)


def test_a_step_that_keeps_no_token_changes_nothing(learners):
    learner = learners[1]
    batch, lp, ent, drop, extras = _case(learner, seed=6)
    extras = extras | {"old_logprobs_BT": lp - 2.0}  # every ratio e^2 > BOUND
    before = {n: p.detach().clone() for n, p in learner.module.named_parameters()}
    step = learner.step
    mb = TrainBatch(tokens_BT=batch.tokens_BT, attention_mask_BT=batch.attention_mask_BT,
                    loss_mask_BT=batch.loss_mask_BT, extras=extras)
    loss_fn = TokenLoss(token_loss=PolicyLoss(LossConfig(), high_ratio_bound=BOUND), with_entropy=True)
    result = learner.train_step(mb, loss_fn)
    assert result.loss == 0.0 and result.metrics[KEEP_METRIC] == 0.0 and not result.skipped
    assert learner.step == step
    assert all(torch.equal(p, before[n]) for n, p in learner.module.named_parameters())


def keep_run(rank: int, world: int, tp: int, pp: int, out: str) -> None:
    """At ``tp`` x ``pp`` (the rest data parallel): (loss, grad norm) of the filtered and the masked step,
    per aggregation; rank 0 saves them."""
    from megatron_tir.policy.parallel import init_parallel

    init_parallel(tp, pp)
    learner = _learner(16, tp, pp)
    res = {}
    for aggregation in ("token_mean", "seq_mean"):
        filtered, plain = _losses(aggregation)
        batch, _, _, drop, extras = _case(learner)
        for name, mask, fn in (("filtered", batch.loss_mask_BT, filtered),
                               ("masked", batch.loss_mask_BT * ~drop, plain)):
            r, _ = _step(learner, batch, mask, extras, fn, aggregation)
            res[aggregation, name] = (r.loss, r.grad_norm)
    if rank == 0:
        torch.save(res, out)


@pytest.mark.parametrize("layout", ["dp2", "pp2"])
def test_kept_counts_are_summed_over_replicas_and_stages(learners, layout, tmp_path):
    """DP=2 (each replica counts its own rows' kept tokens) and PP=2 (only the last stage runs the
    loss; the first stage's gradients are rescaled too): the filtered step equals the masked one and
    the hand reference of one process. Two spawned ranks (~40 s each layout)."""
    tp, pp = {"dp2": (1, 1), "pp2": (1, 2)}[layout]
    out = tmp_path / "keep.pt"
    run_ranks(keep_run, 2, tp, pp, str(out))
    res = torch.load(out)
    for aggregation in ("token_mean", "seq_mean"):
        batch, lp, ent, drop, extras = _case(learners[1])
        loss_BT, _ = _losses(aggregation)[1](lp, ent, extras)
        want = float(aggregate(loss_BT, batch.loss_mask_BT * ~drop, aggregation))
        (lf, nf), (lm, nm) = res[aggregation, "filtered"], res[aggregation, "masked"]
        print(f"{layout} {aggregation}: loss filtered {lf:.6f} masked {lm:.6f} hand {want:.6f}; "
              f"grad norm {nf:.6f} vs {nm:.6f}")
        assert abs(lf - want) <= 1e-5 * abs(want) and abs(lm - want) <= 1e-5 * abs(want)
        assert abs(nf - nm) <= 1e-5 * nm

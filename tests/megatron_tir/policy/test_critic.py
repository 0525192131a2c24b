"""The critic: the policy's GPTModel with a one-output value head. It starts from the policy's
backbone with a zero head, fits constant returns, trains the same at TP=2 and PP=2 as at TP=1,
and saves / loads bit-identically."""

from __future__ import annotations

import pytest
import torch
from learner_testing import critic_run, make_batch, value_batch

from megatron_tir.policy.learner_config import LearnerConfig
from megatron_tir.policy.parallel import run_ranks


def _critic(**kw):
    from megatron_tir.policy.learner import Learner

    return Learner(LearnerConfig(**{"model": "tiny-qwen2", "head": "value", "lr": 1e-3, **kw}))


def test_critic_starts_from_the_policy_backbone_with_zero_values(parallel_1x1):
    from megatron_tir.policy.learner import Learner

    critic = _critic()
    policy = Learner(LearnerConfig(model="tiny-qwen2"))
    batch = make_batch(4)
    assert torch.equal(critic.values(batch.tokens_BT, batch.attention_mask_BT), torch.zeros(batch.tokens_BT.shape))
    pol = {k: v for k, v in policy.module.state_dict().items() if "output_layer" not in k and "extra_state" not in k}
    cri = critic.module.state_dict()
    assert pol and all(torch.equal(v, cri[k]) for k, v in pol.items())  # the backbone is the policy's
    assert tuple(cri["output_layer.weight"].shape) == (1, critic.spec.hidden_size)
    with pytest.raises(ValueError, match="no log-probs"):
        critic.logprobs(batch.tokens_BT, batch.attention_mask_BT)
    with pytest.raises(ValueError, match="needs a critic"):
        policy.values(batch.tokens_BT, batch.attention_mask_BT)
    with pytest.raises(ValueError, match="learner.head"):
        LearnerConfig(model="tiny-qwen2", head="q")


def test_critic_fits_constant_returns(parallel_1x1):
    from megatron_tir.policy.losses import ValueLoss
    from megatron_tir.rl.critic import explained_variance

    critic = _critic(lr=3e-3)
    batch = value_batch(5)
    returns, mask = batch.extras["returns_BT"], batch.loss_mask_BT
    ev, losses = [], []
    for _ in range(8):
        old = critic.values(batch.tokens_BT, batch.attention_mask_BT)
        ev.append(float(explained_variance(old, returns, mask)))
        extras = {"returns_BT": returns, "old_values_BT": old}
        step = critic.train_step(type(batch)(tokens_BT=batch.tokens_BT, attention_mask_BT=batch.attention_mask_BT,
                                             loss_mask_BT=mask, extras=extras), ValueLoss(clip=None))
        losses.append(step.loss)
    print(f"critic fit: value loss {losses[0]:.4f} -> {losses[-1]:.4f}, explained variance {ev[0]:.3f} -> {ev[-1]:.3f}")
    assert losses[-1] < 0.5 * losses[0]
    assert ev[-1] > ev[0] + 0.3


def test_critic_save_load_continues_bit_identically(parallel_1x1, tmp_path):
    from megatron_tir.policy.checkpoint.learner_io import load_learner, save_learner
    from megatron_tir.policy.losses import ValueLoss

    a = _critic()
    a.train_step(value_batch(6), ValueLoss())
    save_learner(a, tmp_path / "critic")
    b = _critic()
    load_learner(b, tmp_path / "critic")
    ra, rb = a.train_step(value_batch(7), ValueLoss()), b.train_step(value_batch(7), ValueLoss())
    assert (ra.loss, ra.grad_norm) == (rb.loss, rb.grad_norm)
    probe = make_batch(8)
    assert torch.equal(a.values(probe.tokens_BT, probe.attention_mask_BT),
                       b.values(probe.tokens_BT, probe.attention_mask_BT))


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_critic_layout_equals_tp1(tp, pp, tmp_path):
    run_ranks(critic_run, 1, 1, 1, str(tmp_path / "ref.pt"))
    run_ranks(critic_run, tp * pp, tp, pp, str(tmp_path / "got.pt"))
    ref, got = torch.load(tmp_path / "ref.pt"), torch.load(tmp_path / "got.pt")
    diff = (got["after"] - ref["after"]).abs().max().item()
    print(f"critic tp={tp} pp={pp}: max |values - tp1| after 2 steps = {diff:.2e}")
    assert torch.equal(got["before"], ref["before"])  # zero head: all zeros
    assert diff <= 1e-4 and (got["after"] - got["before"]).abs().max() > 1e-3
    assert (got["head"] - ref["head"]).abs().max() <= 2e-6
    for (loss, norm, skipped), (rloss, rnorm, rskipped) in zip(got["steps"], ref["steps"]):
        assert not skipped and not rskipped
        assert loss == pytest.approx(rloss, rel=1e-5, abs=1e-6) and norm == pytest.approx(rnorm, rel=1e-4)

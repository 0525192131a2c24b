"""The learner-side diagnostics: ppo_kl and per-turn ratio on hand-made tensors; per-turn entropy and
ratio of a real learner step against a direct computation from transformers logits (within 1e-4)."""

from __future__ import annotations

import pytest
import torch

from megatron_tir.observe.probe import TurnProbe
from megatron_tir.rl import LossConfig, PolicyLoss


def test_probe_on_hand_made_tensors():
    logp = torch.log(torch.tensor([[0.5, 0.2, 0.4, 0.1]]))
    old = torch.log(torch.tensor([[0.25, 0.2, 0.8, 0.1]]))
    turn = torch.tensor([[0, 0, 1, -1]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    extras = {"old_logprobs_BT": old, "advantages_BT": torch.ones(1, 4), "loss_mask_BT": mask, "turn_index_BT": turn}
    probe = TurnProbe(PolicyLoss(LossConfig()), n_turns=2)
    _, metrics = probe(logp, torch.tensor([[1.0, 2.0, 3.0, 9.0]]), extras)
    # the learner's report: token mean over the loss mask
    means = {k: float((v * mask).sum() / mask.sum()) for k, v in metrics.items()}
    out = probe.finish(means)
    assert out["ratio_mean_turn_0"] == pytest.approx((2.0 + 1.0) / 2) and out["ratio_max_turn_0"] == pytest.approx(2.0)
    assert out["ratio_mean_turn_1"] == pytest.approx(0.5) and out["ratio_max_turn_1"] == pytest.approx(0.5)
    assert out["entropy_turn_0"] == pytest.approx(1.5) and out["entropy_turn_1"] == pytest.approx(3.0)
    # verl ppo_kl: mean(old - logp) over loss tokens
    assert out["ppo_kl"] == pytest.approx(float((old - logp)[0, :3].mean()))
    assert not any(k.startswith(("tokens_turn_", "ratio_turn_")) for k in out)


@pytest.fixture(scope="module")
def learner():
    from megatron_tir.policy.learner import Learner
    from megatron_tir.policy.learner_config import LearnerConfig
    from megatron_tir.policy.parallel import destroy_parallel, init_parallel

    init_parallel(1, 1)
    yield Learner(LearnerConfig(model="tiny-qwen2", lr=1e-4, max_tokens_per_microbatch=24))
    destroy_parallel()


def test_per_turn_entropy_and_ratio_of_a_learner_step_equal_transformers(learner):
    from transformers import AutoModelForCausalLM

    from megatron_tir.model_sources import resolve_model
    from megatron_tir.policy.learner_contract import TrainBatch
    from megatron_tir.policy.losses import TokenLoss

    g = torch.Generator().manual_seed(0)
    B, T = 3, 14
    tokens = torch.randint(0, 49152, (B, T), generator=g)
    attn = torch.ones(B, T, dtype=torch.bool)
    attn[2, 11:] = False
    tokens[~attn] = 0
    turn = torch.full((B, T), -1)
    turn[:, 3:7], turn[:, 8:11] = 0, 1  # prompt 0..2, turn 0, a feedback token at 7, turn 1
    mask = (turn >= 0).float() * attn
    old = -torch.rand(B, T, generator=g) * 3 - 9
    batch = TrainBatch(tokens_BT=tokens, attention_mask_BT=attn, loss_mask_BT=mask,
                       extras={"old_logprobs_BT": old, "advantages_BT": torch.randn(B, T, generator=g),
                               "loss_mask_BT": mask, "turn_index_BT": turn})
    model = AutoModelForCausalLM.from_pretrained(resolve_model("tiny-qwen2"), dtype=torch.float32).eval()
    with torch.no_grad():  # the weights the step's forward pass uses (before its optimizer update)
        logits = model(tokens).logits.float()
    logp_all = torch.log_softmax(logits, -1)
    ent_BT = torch.zeros(B, T)
    lp_BT = torch.zeros(B, T)
    ent_BT[:, 1:] = -(logp_all.exp() * logp_all).sum(-1)[:, :-1]  # column t: the distribution that predicted t
    lp_BT[:, 1:] = logp_all[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
    probe = TurnProbe(PolicyLoss(LossConfig()), n_turns=2)
    result = learner.train_step(batch, TokenLoss(token_loss=probe, with_entropy=True))
    out = probe.finish(result.metrics)
    for k in (0, 1):
        sel = (turn == k) & attn
        assert out[f"entropy_turn_{k}"] == pytest.approx(float(ent_BT[sel].mean()), abs=1e-4)
        ratio = torch.exp(lp_BT[sel] - old[sel])
        assert out[f"ratio_mean_turn_{k}"] == pytest.approx(float(ratio.mean()), rel=1e-4)
        assert out[f"ratio_max_turn_{k}"] == pytest.approx(float(ratio.max()), rel=1e-4)
    assert out["ppo_kl"] == pytest.approx(float((old - lp_BT)[mask > 0].mean()), abs=1e-4)

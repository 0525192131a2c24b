"""The head-agnostic learner: an SFT (NLL) loss through the same ``train_step`` as the policy loss,
checked against transformers' own causal-LM loss; a frozen reference model is forward only."""

from __future__ import annotations

import pytest
import torch
from learner_testing import make_batch, ppo_loss

from megatron_tir.policy.learner_config import LearnerConfig


def _learner(**kw):
    from megatron_tir.policy.learner import Learner

    frozen = kw.pop("frozen", False)
    return Learner(LearnerConfig(**{"model": "tiny-qwen2", "lr": 1e-4, **kw}), frozen=frozen)


def test_sft_nll_loss_through_train_step_equals_transformers_loss_and_grad_norm(parallel_1x1):
    """NLLLoss, token mean over the loss mask: the step's loss is transformers' ``labels=`` loss
    (labels -100 off the mask) and its grad norm equals transformers' (4 micro-batches)."""
    from transformers import AutoModelForCausalLM

    from megatron_tir.model_sources import resolve_model
    from megatron_tir.policy.losses import NLLLoss

    learner = _learner(max_tokens_per_microbatch=16)
    batch = make_batch(11)
    assert len(learner._micro_batches(batch.attention_mask_BT)) == 4
    result = learner.train_step(batch, NLLLoss(), aggregation="token_mean")

    hf = AutoModelForCausalLM.from_pretrained(resolve_model("tiny-qwen2"), dtype=torch.float32)
    total, count = 0.0, 0
    for b in range(batch.tokens_BT.shape[0]):  # each row alone (no padding), summed NLL
        idx = batch.attention_mask_BT[b].nonzero().flatten()
        s, e = int(idx[0]), int(idx[-1]) + 1
        labels = batch.tokens_BT[b:b + 1, s:e].clone()
        labels[batch.loss_mask_BT[b:b + 1, s:e] == 0] = -100
        labels[:, 0] = -100  # nothing predicts a row's first token
        n = int((labels != -100).sum())
        out = hf(batch.tokens_BT[b:b + 1, s:e], labels=labels)  # mean over the row's labelled tokens
        total = total + out.loss * n
        count += n
    ref_loss = total / count
    ref_loss.backward()
    ref_loss = ref_loss.item()
    ref_norm = torch.sqrt(sum((p.grad ** 2).sum() for p in hf.parameters() if p.grad is not None)).item()
    print(f"sft nll: learner loss {result.loss:.6f} vs transformers {ref_loss:.6f}; "
          f"grad norm {result.grad_norm:.6f} vs {ref_norm:.6f}")
    assert not result.skipped and learner.step == 1
    assert result.loss == pytest.approx(ref_loss, rel=1e-5)
    assert result.metrics["nll"] == pytest.approx(result.loss, rel=1e-6)
    assert result.grad_norm == pytest.approx(ref_norm, rel=1e-4)


def test_frozen_reference_is_forward_only(parallel_1x1, tmp_path):
    from megatron_tir.policy.checkpoint.learner_io import load_learner, save_learner

    policy = _learner()
    reference = _learner(frozen=True)
    batch = make_batch(12)
    assert reference.optimizer is None and reference.scheduler is None and reference.frozen
    params = list(reference.module.parameters())
    assert params and not any(p.requires_grad for p in params)
    assert not any(hasattr(p, "main_grad") for p in params)  # DDP's gradient buffers
    assert all(hasattr(p, "main_grad") for p in policy.module.parameters())  # (what the policy has)
    assert reference._model is reference.module  # no DDP wrapper
    before = reference.logprobs(batch.tokens_BT, batch.attention_mask_BT)
    assert torch.equal(before, policy.logprobs(batch.tokens_BT, batch.attention_mask_BT))
    with pytest.raises(ValueError, match="frozen learner does not train"):
        reference.train_step(batch, ppo_loss)
    policy.train_step(batch, ppo_loss)
    moved = policy.logprobs(batch.tokens_BT, batch.attention_mask_BT)
    after = reference.logprobs(batch.tokens_BT, batch.attention_mask_BT)
    assert torch.equal(after, before) and not torch.equal(moved, before)
    # a frozen learner's checkpoint is its model only; it loads into another frozen learner
    save_learner(reference, tmp_path / "ref")
    other = _learner(frozen=True)
    load_learner(other, tmp_path / "ref")
    assert torch.equal(other.logprobs(batch.tokens_BT, batch.attention_mask_BT), before)
    with pytest.raises(ValueError, match="no optimizer/scheduler state"):
        load_learner(policy, tmp_path / "ref")

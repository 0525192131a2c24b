"""The log-prob phase reports progress: one tick per micro-batch forward (the trainer's bar)."""

from __future__ import annotations

import torch
from learner_testing import make_batch

from megatron_tir.policy.learner_config import LearnerConfig


def test_logprobs_tick_once_per_micro_batch(parallel_1x1):
    from megatron_tir.policy.learner import Learner

    learner = Learner(LearnerConfig(model="tiny-qwen2", lr=1e-4, max_tokens_per_microbatch=16))
    batch = make_batch(3)
    n = len(learner._micro_batches(batch.attention_mask_BT))
    ticks = []
    lp = learner.logprobs(batch.tokens_BT, batch.attention_mask_BT, tick=lambda: ticks.append(1))
    assert n == 4 and len(ticks) == n
    assert torch.equal(lp, learner.logprobs(batch.tokens_BT, batch.attention_mask_BT))  # progress changes nothing

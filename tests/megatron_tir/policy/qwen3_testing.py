"""Shared by the Qwen3 / Qwen3-MoE learner tests: one run of a tiny model at a layout (spawned ranks)."""

from __future__ import annotations

import torch
from learner_testing import make_batch, ppo_loss


def qwen3_run(rank: int, world: int, model: str, tp: int, pp: int, ep: int, out: str) -> None:
    """At ``tp`` x ``pp`` (x ``ep`` expert-parallel): log-probs of batch 1, one Adam step on batch 2, the
    exported HF weights and the log-probs after the step; rank 0 saves them to ``out``."""
    from megatron_tir.policy.learner import Learner
    from megatron_tir.policy.learner_config import LearnerConfig
    from megatron_tir.policy.parallel import init_parallel

    init_parallel(tp, pp, **({"ep": ep} if ep > 1 else {}))
    learner = Learner(LearnerConfig(model=model, tp=tp, pp=pp, lr=1e-3, max_tokens_per_microbatch=64,
                                    **({"ep": ep} if ep > 1 else {})))
    probe = make_batch(1)
    lp = learner.logprobs(probe.tokens_BT, probe.attention_mask_BT)
    step = learner.train_step(make_batch(2), ppo_loss, aggregation="token_mean")
    weights = {name: t.clone() for bucket in learner.hf_weights(1 << 20) for name, t in bucket}
    after = learner.logprobs(probe.tokens_BT, probe.attention_mask_BT)
    if rank == 0:
        torch.save({"logprobs": lp, "after": after, "weights": weights, "loss": step.loss,
                    "grad_norm": step.grad_norm}, out)

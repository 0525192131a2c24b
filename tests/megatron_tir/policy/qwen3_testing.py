"""Shared by the Qwen3 / Qwen3-MoE learner tests: one run of a tiny model at a layout (spawned ranks)."""

from __future__ import annotations

import torch
from learner_testing import make_batch, ppo_loss


def qwen3_run(rank: int, world: int, model: str, tp: int, pp: int, ep: int, out: str,
              learner: dict | None = None) -> None:
    """At ``tp`` x ``pp`` (x ``ep`` expert-parallel): log-probs of batch 1, one Adam step on batch 2, the
    exported HF weights and the log-probs after the step; rank 0 saves them to ``out``. ``learner``:
    more ``LearnerConfig`` fields."""
    from megatron_tir.policy.learner import Learner
    from megatron_tir.policy.learner_config import LearnerConfig
    from megatron_tir.policy.parallel import init_parallel

    init_parallel(tp, pp, ep=ep)
    learner = Learner(LearnerConfig(model=model, tp=tp, pp=pp, lr=1e-3, max_tokens_per_microbatch=64,
                                    ep=ep, **(learner or {})))
    probe = make_batch(1)
    lp = learner.logprobs(probe.tokens_BT, probe.attention_mask_BT)
    step = learner.train_step(make_batch(2), ppo_loss, aggregation="token_mean")
    weights = {name: t.clone() for bucket in learner.hf_weights(1 << 20) for name, t in bucket}
    after = learner.logprobs(probe.tokens_BT, probe.attention_mask_BT)
    experts = {n.split(".local_experts.")[1].split(".")[0] for n, _ in learner.module.named_parameters()
               if ".local_experts." in n}  # this rank's share of the experts
    if rank == 0:
        torch.save({"logprobs": lp, "after": after, "weights": weights, "loss": step.loss,
                    "grad_norm": step.grad_norm, "local_experts": len(experts)}, out)


def hf_dir_with(weights: dict, like, out):
    """An HF directory at ``out``: ``like``'s config and tokenizer with ``weights`` (HF file names) as
    its tensors -- loaded by ``from_pretrained``, which reads Qwen3-MoE's per-expert file names
    (``load_state_dict`` on the module would not: transformers fuses the experts in memory)."""
    import shutil
    from pathlib import Path

    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(like).iterdir():
        if f.suffix in (".json", ".jinja") and f.name != "model.safetensors.index.json":
            shutil.copy(f, out / f.name)
    save_file({k: v.contiguous() for k, v in weights.items()}, out / "model.safetensors", metadata={"format": "pt"})
    return out


def routing_run(rank: int, world: int, ep: int, out: str) -> None:
    """Tiny Qwen3-MoE at EP=``ep`` (dp = ep: rows dealt over the replicas): the routing recorded in an
    old pass, then, after two large updates, a replayed update's routing and its changed share."""
    from megatron_tir.policy.learner import Learner
    from megatron_tir.policy.learner_config import LearnerConfig
    from megatron_tir.policy.parallel import init_parallel

    init_parallel(1, 1, ep=ep)
    learner = Learner(LearnerConfig(model="tiny-qwen3-moe", lr=5e-2, max_tokens_per_microbatch=24, ep=ep))
    probe = make_batch(1)
    learner.logprobs(probe.tokens_BT, probe.attention_mask_BT)
    record = learner.routing.recorded.clone()
    for seed in (2, 3):
        learner.train_step(make_batch(seed), ppo_loss)
    with learner.routing.replaying(record):
        learner.train_step(probe, ppo_loss)
    if rank == 0:
        torch.save({"record": record, "replayed": learner.routing.recorded.clone(),
                    "changed": learner.routing.changed_share}, out)

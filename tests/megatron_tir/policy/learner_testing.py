"""Shared by the learner tests: batches, a PPO-style loss, transformers references, layout runs."""

from __future__ import annotations

import asyncio

from pathlib import Path

import torch

from megatron_tir.policy.learner_contract import TrainBatch
from megatron_tir.policy.losses import TokenLoss


def make_batch(seed: int = 0, *, rows: int = 4, length: int = 16, vocab: int = 49152) -> TrainBatch:
    """Rows of different lengths, right-padded, one left-padded; loss on the last ~2/3 of each row."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (rows, length), generator=g)
    attn = torch.zeros(rows, length, dtype=torch.bool)
    loss = torch.zeros(rows, length)
    for b in range(rows):
        n = length - 3 * b if b % 2 == 0 else length - b
        start = 2 if b == 1 else 0
        attn[b, start:start + n - start] = True
        loss[b, start + (n - start) // 3:n] = 1.0
    tokens[~attn] = 0
    old = -torch.rand(rows, length, generator=g) * 5 - 8
    adv = torch.randn(rows, generator=g)
    return TrainBatch(tokens_BT=tokens, attention_mask_BT=attn, loss_mask_BT=loss,
                      extras={"old_logprobs": old, "advantages": adv})


def ppo_token_loss(logprobs_BT, entropy_BT, extras):
    """Clipped-ratio policy loss with an entropy term (when given); metrics: ratio, clipped."""
    ratio = torch.exp(logprobs_BT - extras["old_logprobs"]).clamp(max=1e4)
    adv = extras["advantages"].unsqueeze(1)
    loss = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.28) * adv)
    if entropy_BT is not None:
        loss = loss - 1e-3 * entropy_BT
    return loss, {"ratio": ratio.detach(), "clipped": (ratio.detach() - ratio.detach().clamp(0.8, 1.28)).ne(0).float()}


ppo_loss = TokenLoss(token_loss=ppo_token_loss)
ppo_loss_with_entropy = TokenLoss(token_loss=ppo_token_loss, with_entropy=True)


def hf_logprobs(hf_dir: Path, tokens_BT: torch.Tensor, attention_mask_BT: torch.Tensor, *,
                temperature: float = 1.0, state_dict: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, entropy) ``[B, T]`` of each row's span from a transformers forward (float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    if state_dict is not None:
        model.load_state_dict(state_dict, strict=False)
    lp = torch.zeros(tokens_BT.shape)
    ent = torch.zeros(tokens_BT.shape)
    with torch.no_grad():
        for b in range(tokens_BT.shape[0]):
            idx = attention_mask_BT[b].nonzero().flatten()
            s, e = int(idx[0]), int(idx[-1]) + 1
            logp = torch.log_softmax(model(tokens_BT[b:b + 1, s:e]).logits[0].float() / temperature, dim=-1)
            lp[b, s + 1:e] = logp[:-1].gather(1, tokens_BT[b, s + 1:e, None])[:, 0]
            ent[b, s + 1:e] = -(logp.exp() * logp).sum(-1)[:-1]
    return lp, ent


def layout_run(rank: int, world: int, tp: int, pp: int, distributed_optimizer: bool, out: str,
               with_engine: bool) -> None:
    """On ``world`` ranks at ``tp`` x ``pp``: log-probs of batch 1, two Adam steps (token_mean, then
    seq_mean), the exported HF weights; with ``with_engine`` the weights are synced into a
    LocalEngine on rank 0 and its model's log-probs are recorded. Rank 0 saves all to ``out``."""
    from megatron_tir.policy.learner import Learner
    from megatron_tir.policy.learner_config import LearnerConfig
    from megatron_tir.policy.parallel import init_parallel
    from megatron_tir.rollout.sync import drain
    from megatron_tir.rollout.sync.local import LocalWeightSync

    init_parallel(tp, pp)
    learner = Learner(LearnerConfig(model="tiny-qwen2", tp=tp, pp=pp, lr=1e-4, max_tokens_per_microbatch=24,
                                    distributed_optimizer=distributed_optimizer))
    probe = make_batch(1)
    lp, ent = learner.logprobs(probe.tokens_BT, probe.attention_mask_BT, temperature=0.7, with_entropy=True)
    steps = [learner.train_step(make_batch(2), ppo_loss_with_entropy, aggregation="token_mean"),
             learner.train_step(make_batch(3), ppo_loss, aggregation="seq_mean")]
    weights = {name: t.clone() for bucket in learner.hf_weights(1 << 20) for name, t in bucket}
    result = {"logprobs": lp, "entropy": ent, "weights": weights,
              "steps": [(s.loss, s.grad_norm, s.metrics["ratio"], s.skipped) for s in steps],
              "after": learner.logprobs(probe.tokens_BT, probe.attention_mask_BT)}
    if with_engine:
        engine = None
        if rank == 0:
            from megatron_tir.rollout.engines.local import LocalEngine, LocalEngineConfig

            engine = LocalEngine(LocalEngineConfig(model="tiny-qwen2", eos_token_ids=(0,)))
        buckets = learner.named_hf_buckets(1 << 20)
        if engine is None:
            drain(buckets)
        else:
            asyncio.run(LocalWeightSync(engine).update(buckets))
        if engine is not None:
            result["engine_logprobs"] = _model_logprobs(engine.model, probe.tokens_BT, probe.attention_mask_BT)
    if rank == 0:
        torch.save(result, out)


def _model_logprobs(model, tokens_BT, attention_mask_BT) -> torch.Tensor:
    lp = torch.zeros(tokens_BT.shape)
    with torch.no_grad():
        for b in range(tokens_BT.shape[0]):
            idx = attention_mask_BT[b].nonzero().flatten()
            s, e = int(idx[0]), int(idx[-1]) + 1
            logp = torch.log_softmax(model(tokens_BT[b:b + 1, s:e]).logits[0].float(), dim=-1)
            lp[b, s + 1:e] = logp[:-1].gather(1, tokens_BT[b, s + 1:e, None])[:, 0]
    return lp


def logprobs_run(rank: int, world: int, model: str, tp: int, pp: int, ids: str, out: str) -> None:
    """Log-probs of the saved ``(tokens, mask)`` at ``tp`` x ``pp``; rank 0 saves them."""
    from megatron_tir.policy.learner import Learner
    from megatron_tir.policy.learner_config import LearnerConfig
    from megatron_tir.policy.parallel import init_parallel

    init_parallel(tp, pp)
    learner = Learner(LearnerConfig(model=model, tp=tp, pp=pp))
    tokens, mask = torch.load(ids)
    lp = learner.logprobs(tokens, mask)
    if rank == 0:
        torch.save(lp, out)


def value_batch(seed: int) -> TrainBatch:
    """``make_batch(seed)`` with a critic's extras: returns (a constant per row) and old values."""
    batch = make_batch(seed)
    returns = batch.extras["advantages"][:, None].expand_as(batch.loss_mask_BT) * batch.loss_mask_BT
    return TrainBatch(tokens_BT=batch.tokens_BT, attention_mask_BT=batch.attention_mask_BT,
                      loss_mask_BT=batch.loss_mask_BT,
                      extras={"returns_BT": returns.contiguous(), "old_values_BT": torch.zeros_like(returns)})


def critic_run(rank: int, world: int, tp: int, pp: int, out: str) -> None:
    """A tiny-qwen2 critic at ``tp`` x ``pp``: values of batch 1, two value-loss steps, values after
    and the value head's weight. Rank 0 saves them to ``out``."""
    from megatron.core import parallel_state

    from megatron_tir.policy.learner import Learner
    from megatron_tir.policy.learner_config import LearnerConfig
    from megatron_tir.policy.losses import ValueLoss
    from megatron_tir.policy.parallel import init_parallel

    init_parallel(tp, pp)
    critic = Learner(LearnerConfig(model="tiny-qwen2", head="value", tp=tp, pp=pp, lr=1e-3,
                                   max_tokens_per_microbatch=24))
    probe = make_batch(1)
    before = critic.values(probe.tokens_BT, probe.attention_mask_BT)
    steps = [critic.train_step(value_batch(s), ValueLoss(clip=None)) for s in (2, 3)]
    after = critic.values(probe.tokens_BT, probe.attention_mask_BT)
    head = None
    if parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0:
        head = critic.module.output_layer.weight.detach().clone()
    heads = [None] * world
    torch.distributed.all_gather_object(heads, head)
    if rank == 0:
        torch.save({"before": before, "after": after, "head": next(h for h in heads if h is not None),
                    "steps": [(s.loss, s.grad_norm, s.skipped) for s in steps]}, out)

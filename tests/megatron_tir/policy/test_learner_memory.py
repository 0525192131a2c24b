"""Memory settings of the learner: sequence parallelism, activation recomputation and FP8 reach megatron-core's
TransformerConfig; micro-batches padded to TP x 16 keep the log-probs; recomputation keeps the step."""

from __future__ import annotations

import pytest
import torch
from learner_testing import make_batch, ppo_loss

from megatron_tir.policy.learner_config import LearnerConfig
from megatron_tir.policy.microbatch import padding_share, plan_microbatches


def _learner(**kw):
    from megatron_tir.policy.learner import Learner

    return Learner(LearnerConfig(**{"model": "tiny-qwen2", "lr": 1e-4, "max_tokens_per_microbatch": 64, **kw}))


def test_memory_and_fp8_settings_reach_the_transformer_config():
    from megatron_tir.model_sources import resolve_model
    from megatron_tir.policy.spec import spec_from_hf_dir

    spec, _ = spec_from_hf_dir(resolve_model("tiny-qwen2"))
    cfg = LearnerConfig(model="tiny-qwen2", tp=2, sequence_parallel=True, recompute_granularity="full",
                        recompute_method="block", recompute_num_layers=1, fp8="hybrid", fp8_recipe="tensorwise",
                        fp8_amax_history_len=16, fp8_amax_compute_algo="most_recent")
    tc = spec.transformer_config(tp=2, pp=1, **cfg.transformer_overrides())
    assert tc.sequence_parallel is True and tc.tensor_model_parallel_size == 2
    assert (tc.recompute_granularity, tc.recompute_method, tc.recompute_num_layers) == ("full", "block", 1)
    assert (tc.fp8, tc.fp8_recipe, tc.fp8_amax_history_len, tc.fp8_amax_compute_algo) == \
        ("hybrid", "tensorwise", 16, "most_recent")
    assert cfg.pad_multiple == 16  # lcm(TP 2, FP8 16)
    assert LearnerConfig(tp=3, sequence_parallel=True, pad_to_multiple=4).pad_multiple == 12
    sel = LearnerConfig(recompute_granularity="selective")
    tc = spec.transformer_config(**sel.transformer_overrides())
    assert tc.recompute_granularity == "selective" and tc.recompute_modules == ["core_attn"] and tc.fp8 is None


@pytest.mark.parametrize("kw, message", [
    (dict(sequence_parallel=True), "tp > 1"),
    (dict(recompute_granularity="full"), "recompute_method"),
    (dict(recompute_granularity="full", recompute_method="uniform"), "recompute_num_layers"),
    (dict(recompute_granularity="selective", recompute_num_layers=2), "selective takes no"),
    (dict(recompute_method="uniform"), "need learner.recompute_granularity"),
    (dict(fp8="e4m3", fp8_recipe="nvfp4"), "fp8_recipe"),
    (dict(fp8_amax_compute_algo="mean"), "fp8_amax_compute_algo"),
    (dict(fp8="e4m3", max_tokens_per_microbatch=8), "padding multiple 16"),
])
def test_config_refuses_what_megatron_core_refuses(kw, message):
    with pytest.raises(ValueError, match=message):
        LearnerConfig(**kw)


def test_sequence_parallel_without_transformer_engine_is_refused_by_the_learner():
    from megatron_tir.policy.learner import Learner

    # the local spec's torch norms assert `not config.sequence_parallel` (megatron/core/transformer/torch_norm.py);
    with pytest.raises(ValueError, match="sequence_parallel needs Transformer Engine"):
        Learner(LearnerConfig(model="tiny-qwen2", tp=2, sequence_parallel=True))


def test_padded_micro_batches_count_the_padding_against_the_budget():
    attn = torch.zeros(5, 40, dtype=torch.bool)
    for b, n in enumerate([33, 20, 17, 5, 1]):
        attn[b, :n] = True
    mbs = plan_microbatches(attn, max_tokens=80, pad_to=16)
    assert all(mb.length % 16 == 0 and mb.padded_tokens <= 80 or len(mb.rows) == 1 for mb in mbs)
    assert [(mb.rows, mb.length) for mb in mbs] == [([0], 48), ([1, 2], 32), ([3, 4], 16)]  # 48 x 2 > 80
    plain = plan_microbatches(attn, max_tokens=80)
    assert padding_share(mbs) > padding_share(plain)
    assert sum(mb.real_tokens for mb in mbs) == sum(mb.real_tokens for mb in plain) == 76


def test_padding_to_tp_x_16_keeps_logprobs_and_the_step(parallel_1x1):
    batch = make_batch(4, rows=4, length=21)
    plain, padded = _learner(), _learner(pad_to_multiple=32)  # TP 2 x FP8 16, as a TP=2 SP+FP8 run pads
    lp = plain.logprobs(batch.tokens_BT, batch.attention_mask_BT)
    lp_pad = padded.logprobs(batch.tokens_BT, batch.attention_mask_BT)
    assert (lp - lp_pad).abs().max() <= 1e-4
    a = plain.train_step(batch, ppo_loss)
    b = padded.train_step(batch, ppo_loss)
    assert b.padding_share > a.padding_share
    assert abs(a.loss - b.loss) <= 1e-4 and abs(a.grad_norm - b.grad_norm) <= 1e-4 * max(1.0, a.grad_norm)


@pytest.mark.parametrize("kw", [dict(recompute_granularity="selective"),
                                dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)])
def test_recomputation_reaches_the_model_and_keeps_the_step(parallel_1x1, kw):
    batch = make_batch(5, rows=4, length=18)
    plain, recomputed = _learner(), _learner(**kw)
    config = recomputed._model.module.config
    assert config.recompute_granularity == kw["recompute_granularity"]
    assert config.recompute_method == kw.get("recompute_method")
    a = plain.train_step(batch, ppo_loss)
    b = recomputed.train_step(batch, ppo_loss)
    assert abs(a.loss - b.loss) <= 1e-5 and abs(a.grad_norm - b.grad_norm) <= 1e-5 * max(1.0, a.grad_norm)
    after_a = plain.logprobs(batch.tokens_BT, batch.attention_mask_BT)
    after_b = recomputed.logprobs(batch.tokens_BT, batch.attention_mask_BT)
    assert (after_a - after_b).abs().max() <= 1e-4

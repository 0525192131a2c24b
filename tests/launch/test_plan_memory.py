"""The planner's learner memory against measurement: peak bytes of real learner steps on CPU (float32, TP=1).

Measured with torch's profiler (``profile_memory=True``): every allocation and free from before the
learner is built, replayed in time order; the peak is the highest live total during the measured
step (so it includes the parameters, gradient buffers and Adam state made since the profile began).
The planner is told the same layout: float32, plain Adam, PP=1, a micro-batch of the token budget.
The planner models megatron-core's layer as Transformer Engine runs it; the local spec measured here
keeps somewhat more (torch's RMSNorm and SDPA on CPU: SmolLM2 measured ~2.0 MB per token against the
planner's 1.4 MB), which stays inside the band (launch/README.md lists the measured ratios).
"""

from __future__ import annotations

import gc

import pytest
import torch

from megatron_tir.launch.plan import GIB, ModelShape, learner_stages

MARK_BYTES = 7_654_321


@pytest.fixture(scope="module")
def parallel_1x1():
    from megatron_tir.policy.parallel import destroy_parallel, init_parallel

    init_parallel(1, 1)
    yield
    destroy_parallel()


def _live_bytes_peak(prof, start_ns: int) -> tuple[float, float]:
    """(live bytes at ``start_ns``, the peak of live bytes after it) from the profile's memory events."""
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live, at_start, peak = 0, None, 0
    for e in events:
        if at_start is None and e.start_ns() >= start_ns:
            at_start = peak = live
        live += e.nbytes()
        if at_start is not None:
            peak = max(peak, live)
    return float(at_start or live), float(peak)


def _batch(rows: int, length: int, vocab: int, seed: int):
    from megatron_tir.policy.learner_contract import TrainBatch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (rows, length), generator=g)
    attn = torch.ones(rows, length, dtype=torch.bool)
    loss = torch.ones(rows, length)
    return TrainBatch(tokens_BT=tokens, attention_mask_BT=attn, loss_mask_BT=loss,
                      extras={"advantages": torch.randn(rows, generator=g)})


def _token_loss(logprobs_BT, entropy_BT, extras):
    return -logprobs_BT * extras["advantages"].unsqueeze(1), {}


def _loss(output, inputs):  # the learner's LossFn: the policy's log-probs from the logits shard
    from megatron_tir.policy.losses import TokenLoss

    return TokenLoss(token_loss=_token_loss)(output, inputs)


def measured_peak(model: str, tokens: int, recompute: str | None) -> tuple[float, object]:
    from torch.profiler import ProfilerActivity, profile

    from megatron_tir.policy.learner import Learner
    from megatron_tir.policy.learner_config import LearnerConfig

    kw = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) \
        if recompute == "full" else {}
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        learner = Learner(LearnerConfig(model=model, lr=1e-5, max_tokens_per_microbatch=tokens, **kw))
        vocab = learner.spec.vocab_size
        learner.train_step(_batch(1, 8, vocab, 0), _loss)  # Adam's state exists from here on
        gc.collect()
        mark = torch.empty(MARK_BYTES, dtype=torch.uint8)  # its allocation event marks the measured step's start
        del mark
        learner.train_step(_batch(2, tokens // 2, vocab, 1), _loss)
    spec = learner.spec
    del learner
    gc.collect()
    (start_ns,) = [e.start_ns() for e in prof.profiler.kineto_results.events()
                   if e.name() == "[memory]" and e.nbytes() == MARK_BYTES]
    _, peak = _live_bytes_peak(prof, start_ns)
    return peak, spec


@pytest.mark.parametrize("model, tokens, recompute", [
    ("tiny-qwen2", 512, None), ("tiny-qwen2", 2048, None), ("tiny-qwen2", 2048, "full"),
    pytest.param("smollm2", 384, None, marks=pytest.mark.slow),  # ~50 s each: SmolLM2 is 135M parameters
    pytest.param("smollm2", 768, "full", marks=pytest.mark.slow),
])
def test_planner_peak_within_20_percent_of_a_measured_learner_step(parallel_1x1, model, tokens, recompute):
    peak, spec = measured_peak(model, tokens, recompute)
    (stage,) = learner_stages(ModelShape.of(spec), tp=1, pp=1, dp=1, tokens=tokens, dtype="float32", sp=False,
                              recompute=recompute, distributed_optimizer=False)
    ratio = stage.peak_bytes / peak
    print(f"{model} {tokens} tokens recompute={recompute}: planner {stage.peak_bytes / GIB:.3f} GiB, "
          f"measured {peak / GIB:.3f} GiB, ratio {ratio:.3f}")
    assert 0.8 <= ratio <= 1.2

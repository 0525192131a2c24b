"""GPU checks of the learner (opt-in: ``pytest -m gpu``): NCCL, bf16 with fp32 main weights,
the Transformer Engine layer spec and FP8, weight sync into a CUDA LocalEngine.

Needs a CUDA GPU; the TE/FP8 checks also need ``transformer_engine``. One process (TP=1):
the single-GPU device this project is lent.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from learner_testing import hf_logprobs, make_batch, ppo_loss

from megatron_tir.policy.learner_config import LearnerConfig

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def nccl_1x1():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from megatron_tir.policy.parallel import destroy_parallel, init_parallel

    init_parallel(1, 1, backend="nccl")
    yield
    destroy_parallel()


def _learner(**kw):
    from megatron_tir.policy.learner import Learner

    return Learner(LearnerConfig(**{"model": "tiny-qwen2", "lr": 1e-4, **kw}))


def test_float32_logprobs_equal_transformers_on_gpu(nccl_1x1):
    from megatron_tir.model_sources import resolve_model

    batch = make_batch(1)
    lp = _learner().logprobs(batch.tokens_BT, batch.attention_mask_BT)
    ref, _ = hf_logprobs(resolve_model("tiny-qwen2"), batch.tokens_BT, batch.attention_mask_BT)
    assert (lp - ref).abs().max() <= 1e-3  # TF32 / cuBLAS reductions


def test_bfloat16_trains_with_fp32_main_weights(nccl_1x1):
    learner = _learner(dtype="bfloat16", model="smollm2")
    assert next(learner._model.module.parameters()).dtype == torch.bfloat16
    batch = make_batch(2)
    results = [learner.train_step(batch, ppo_loss) for _ in range(2)]
    assert all(not r.skipped and 0 < r.grad_norm < float("inf") for r in results)
    assert learner.step == 2


def test_fp8_recipe_with_transformer_engine(nccl_1x1):
    pytest.importorskip("transformer_engine")
    learner = _learner(dtype="bfloat16", fp8="hybrid", model="smollm2")
    result = learner.train_step(make_batch(3, length=32), ppo_loss)
    assert not result.skipped and result.grad_norm > 0


def test_sync_into_a_cuda_local_engine(nccl_1x1):
    from megatron_tir.rollout.engines.local import LocalEngine, LocalEngineConfig
    from megatron_tir.rollout.sync.local import LocalWeightSync

    learner = _learner()
    batch = make_batch(4)
    learner.train_step(batch, ppo_loss)
    engine = LocalEngine(LocalEngineConfig(model="tiny-qwen2", device="cuda", eos_token_ids=(0,)))
    asyncio.run(LocalWeightSync(engine).update(learner.named_hf_buckets()))
    want = dict(learner.hf_weights(1 << 30).__next__())
    got = engine.model.state_dict()
    assert max((got[n].float() - t.float()).abs().max().item() for n, t in want.items()) == 0

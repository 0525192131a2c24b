"""Partial rollouts on the LocalEngine (``trainer.async=full``): a request in flight at a weight sync
with a retract pause continues under the new weights. The same contract as the fake SGLang server's
(test_weight_sync.py ``test_a_retracted_request_is_the_tokens_before_plus_after_the_pause``):
version_testing.check_partial_rollout."""

from __future__ import annotations

import asyncio

from version_testing import check_partial_rollout, weight_sets

from megatron_tir.rollout.engines.base import PauseMode, SamplingParams
from megatron_tir.rollout.engines.local import LocalEngine, LocalEngineConfig
from megatron_tir.rollout.sync import buckets_of
from megatron_tir.rollout.sync.local import LocalWeightSync

PROMPT = [1, 504, 3458, 314, 1470, 30]


def test_a_retracted_request_is_the_tokens_before_plus_after_the_pause(make_tiny_hf):
    tiny = make_tiny_hf("qwen2", tie_word_embeddings=False)
    old, new = weight_sets(tiny, 2)
    params = SamplingParams(max_new_tokens=400, seed=5)

    async def main():
        engine = LocalEngine(LocalEngineConfig(model=str(tiny), eos_token_ids=(0,), seed=0))
        reference = await engine.generate(PROMPT, params)  # the launch weights (old), uninterrupted
        sync = LocalWeightSync(engine, pause_mode=PauseMode.RETRACT)
        task = asyncio.create_task(engine.generate(PROMPT, params))
        while not engine._batch.requests or len(engine._batch.requests[0].token_ids) < 20:  # mid-way
            await asyncio.sleep(0.01)
        await sync.update(buckets_of(new, 64 << 10))
        out = await task
        await engine.close()
        return reference, out

    reference, out = asyncio.run(asyncio.wait_for(main(), 120))
    k = check_partial_rollout(out, reference, PROMPT, tiny, old, new, old="0", new="1")
    assert k >= 20 and out.versions == [0] * k + [1] * (len(out.token_ids) - k)

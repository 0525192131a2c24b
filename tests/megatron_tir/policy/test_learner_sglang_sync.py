"""The learner's buckets into SGLang servers through megatron_tir.rollout.sync.sglang, against
the fake SGLang server process (tests/megatron_tir/rollout/engines/fake_sglang.py: a LocalEngine
behind SGLang's HTTP API that joins the weight-update group with SGLang's own code, over gloo)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import torch
from learner_testing import make_batch, ppo_loss

from megatron_tir.policy.learner_config import LearnerConfig

pytestmark = pytest.mark.slow

FAKE_SERVER = Path(__file__).parents[1] / "rollout" / "engines" / "fake_sglang.py"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from megatron_tir.model_sources import resolve_model
    from megatron_tir.ports import free_port
    from megatron_tir.rollout.engines.sglang import SGLangServer, SGLangServerConfig

    config = SGLangServerConfig(model_path=str(resolve_model("tiny-qwen2")), port=free_port(), random_seed=0,
                                launcher=(sys.executable, str(FAKE_SERVER)),
                                log_file=str(tmp_path_factory.mktemp("fake-sglang") / "server.log"))
    launched = SGLangServer(config).start()
    try:
        launched.wait_healthy(timeout_s=120, poll_s=0.2)
        yield launched
    finally:
        launched.stop()


def test_sync_weights_through_distributed_weight_sync(parallel_1x1, server):
    from megatron_tir.policy.learner import Learner
    from megatron_tir.ports import free_port
    from megatron_tir.rollout.sync.sglang import DistributedWeightSync, DistributedWeightSyncConfig
    from megatron_tir.rollout.engines.base import SamplingParams
    from megatron_tir.rollout.engines.sglang import SGLangEngine, SGLangEngineConfig

    learner = Learner(LearnerConfig(model="tiny-qwen2", lr=1e-2))
    batch = make_batch(7)
    for _ in range(2):
        assert not learner.train_step(batch, ppo_loss).skipped
    prompt = learner.tokenizer("Compute 6 * 7 in python.").input_ids
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3)

    async def main():
        engine = SGLangEngine(SGLangEngineConfig(server_urls=(server.url,), eos_token_ids=(0,),
                                                 health_check_interval_s=0))
        sync = DistributedWeightSync(engine, DistributedWeightSyncConfig(
            master_address="127.0.0.1", master_port=free_port(), backend="gloo", timeout_s=60))
        async with engine:
            before = await engine.generate(prompt, params)
            await sync.start()
            version = await sync.update(learner.named_hf_buckets(64 << 10))
            after = await engine.generate(prompt, params)
            await sync.close()
        return before, after, version, engine.weight_version

    before, after, version, engine_version = asyncio.run(asyncio.wait_for(main(), 180))

    def ratio_error(gen) -> float:
        tokens = torch.tensor([prompt + gen.token_ids])
        ours = learner.logprobs(tokens, torch.ones_like(tokens, dtype=torch.bool))[0, len(prompt):]
        return (torch.exp(ours - torch.tensor(gen.logprobs)) - 1).abs().max().item()

    assert version == engine_version == 1 and after.meta["weight_version"] == "1"  # the first sync
    assert before.versions == [0] * len(before.token_ids) and after.versions == [1] * len(after.token_ids)
    assert ratio_error(after) <= 1e-4  # the server samples with the learner's weights
    assert ratio_error(before) > 1e-3  # and did not before the sync

"""A server process killed and restarted mid-run rejoins the broadcast sync: the group is
rebuilt for it (it came back outside the group, at weight version ``"default"``), its
stale answers are dropped meanwhile, and after the next sync it serves the new weights.

Two fake server processes (fake_sglang.py through SGLangServer) that really join the
weight-update group over gloo, as in test_weight_sync.py.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import torch
from engine_testing import reference_logprobs, run
from transformers import AutoModelForCausalLM

from megatron_tir.ports import free_port
from megatron_tir.rollout.engines.base import FinishReason, SamplingParams
from megatron_tir.rollout.engines.sglang import SGLangEngine, SGLangEngineConfig, SGLangServer, SGLangServerConfig
from megatron_tir.rollout.sync import buckets_of
from megatron_tir.rollout.sync.sglang import DistributedWeightSync, DistributedWeightSyncConfig

pytestmark = pytest.mark.slow

FAKE_SERVER = Path(__file__).with_name("fake_sglang.py")
PROMPT = [1, 504, 3458, 314, 1470, 30]
PARAMS = SamplingParams(max_new_tokens=4, temperature=0.0)


def weights(model_dir, seed: int):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.0 + 0.2 * torch.randn_like(p))
    return model, [(name, tensor.clone()) for name, tensor in model.state_dict().items()]


def test_a_restarted_server_rejoins_a_rebuilt_group_and_serves_the_new_weights(tiny_qwen2, tmp_path):
    configs = [SGLangServerConfig(model_path=str(tiny_qwen2), port=free_port(), random_seed=0,
                                  launcher=(sys.executable, str(FAKE_SERVER)), log_file=str(tmp_path / f"s{i}.log"))
               for i in range(2)]
    servers = [SGLangServer(c).start() for c in configs]
    (_, w1), (model2, w2) = weights(tiny_qwen2, 3), weights(tiny_qwen2, 4)
    try:
        for server in servers:
            server.wait_healthy(timeout_s=120, poll_s=0.2)

        def restart() -> None:
            servers[1].stop()
            servers[1] = SGLangServer(configs[1]).start()
            servers[1].wait_healthy(timeout_s=120, poll_s=0.2)

        async def main():
            engine = SGLangEngine(SGLangEngineConfig(server_urls=tuple(s.url for s in servers), eos_token_ids=(0,),
                                                     health_check_interval_s=0))
            sync = DistributedWeightSync(engine, DistributedWeightSyncConfig(
                master_address="127.0.0.1", master_port=free_port(), backend="gloo", timeout_s=60,
                rejoin_timeout_s=30))
            await sync.start()
            assert await sync.update(buckets_of(w1, 64 << 10)) == 1
            await asyncio.to_thread(restart)  # the agent restarts it: launch weights, not in the group
            during = [await engine.generate(PROMPT, PARAMS) for _ in range(4)]
            stale = engine.stale_responses
            version = await sync.update(buckets_of(w2, 64 << 10))
            after = [await engine.generate(PROMPT, PARAMS) for _ in range(4)]
            await sync.close()
            await engine.close()
            return during, stale, version, after, sync.rebuilds

        during, stale, version, after, rebuilds = run(main(), timeout=300)
    finally:
        for server in servers:
            server.stop()
    assert stale == 1 and rebuilds == 1 and version == 2
    assert all(g.meta["server"] == servers[0].url and g.meta["weight_version"] == "1" for g in during)
    assert {g.meta["server"] for g in after} == {s.url for s in servers}
    for g in after:
        assert g.finish_reason is FinishReason.LENGTH and g.meta["weight_version"] == "2"
        torch.testing.assert_close(torch.tensor(g.logprobs), reference_logprobs(model2, PROMPT, g.token_ids, 1.0),
                                   atol=1e-4, rtol=0)


def test_a_server_down_at_a_sync_is_left_out_of_a_rebuilt_group_and_brought_back_by_the_next(tiny_qwen2, tmp_path):
    """The sync does not wait a load's time for a server that is down while another answers (the
    old 120 s wait ended 32B runs): the group is rebuilt without it (a broadcast into a group with
    a dead member would hang), the run goes on; when it is back the next sync rebuilds the group
    with it and it serves the new weights."""
    configs = [SGLangServerConfig(model_path=str(tiny_qwen2), port=free_port(), random_seed=0,
                                  launcher=(sys.executable, str(FAKE_SERVER)), log_file=str(tmp_path / f"s{i}.log"))
               for i in range(2)]
    servers = [SGLangServer(c).start() for c in configs]
    (_, w1), (_, w2), (model3, w3) = weights(tiny_qwen2, 3), weights(tiny_qwen2, 4), weights(tiny_qwen2, 5)
    try:
        for server in servers:
            server.wait_healthy(timeout_s=120, poll_s=0.2)

        def start_again() -> None:
            servers[1] = SGLangServer(configs[1]).start()
            servers[1].wait_healthy(timeout_s=120, poll_s=0.2)

        async def main():
            engine = SGLangEngine(SGLangEngineConfig(server_urls=tuple(s.url for s in servers), eos_token_ids=(0,),
                                                     health_check_interval_s=0, rejoin_timeout_s=0.5))
            sync = DistributedWeightSync(engine, DistributedWeightSyncConfig(
                master_address="127.0.0.1", master_port=free_port(), backend="gloo", timeout_s=60))
            await sync.start()
            assert await sync.update(buckets_of(w1, 64 << 10)) == 1
            await asyncio.to_thread(servers[1].stop)  # down, not back before the next sync
            v2 = await asyncio.wait_for(sync.update(buckets_of(w2, 64 << 10)), 60)
            members_v2 = sync.members
            during = [await engine.generate(PROMPT, PARAMS) for _ in range(3)]
            await asyncio.to_thread(start_again)
            v3 = await sync.update(buckets_of(w3, 64 << 10))
            after = [await engine.generate(PROMPT, SamplingParams(max_new_tokens=4, temperature=0.0, route_key=f"k{i}"))
                     for i in range(6)]
            await sync.close()
            await engine.close()
            return v2, members_v2, during, v3, sync.members, after, sync.rebuilds

        v2, members_v2, during, v3, members_v3, after, rebuilds = run(main(), timeout=300)
    finally:
        for server in servers:
            server.stop()
    assert (v2, v3, rebuilds) == (2, 3, 2)
    assert members_v2 == (servers[0].url,) and members_v3 == tuple(s.url for s in servers)
    assert all(g.meta["server"] == servers[0].url and g.meta["weight_version"] == "2" for g in during)
    assert {g.meta["server"] for g in after} == {s.url for s in servers}
    for g in after:
        assert g.finish_reason is FinishReason.LENGTH and g.meta["weight_version"] == "3"
        torch.testing.assert_close(torch.tensor(g.logprobs), reference_logprobs(model3, PROMPT, g.token_ids, 1.0),
                                   atol=1e-4, rtol=0)

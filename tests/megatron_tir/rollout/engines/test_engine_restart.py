"""Engines that restart: a server that comes back with its launch weights is seen through its
weight version (sglang 0.5.23 ``meta_info.weight_version`` on every answer, ``/model_info``),
its stale answers are dropped and retried elsewhere, it gets no work until the next sync
brings it up to date; a server later than the sync's wait is left out of that sync (no work until a
later one reaches it), and when no server answers the sync fails in bounded time.

A "restart" is what the launcher's agent does: the server process goes away and a fresh one
listens on the same port, at weight version ``"default"`` (fake_sglang.py rule 9).
``serialize_for_tp_ranks`` needs CUDA: on CPU the payload is a stand-in string.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from engine_testing import run
from fake_sglang import FakeSGLangServer
from sglang_testing import canned_response, client, scripted

from megatron_tir.rollout.engines.base import FinishReason, SamplingParams
from megatron_tir.rollout.engines.sglang import SGLangError
from megatron_tir.rollout.sync import sglang as ws

PARAMS = SamplingParams(max_new_tokens=3)
BUCKETS = [(0, [("model.norm.weight", torch.ones(4))])]


@pytest.fixture(autouse=True)
def cpu_payloads(monkeypatch):
    monkeypatch.setattr(ws, "serialize_for_tp_ranks", lambda bucket, tp, flattened=False: ["c3RhbmQtaW4="] * tp)


def fake(**kwargs) -> FakeSGLangServer:
    return FakeSGLangServer(scripted(canned_response), **kwargs)


async def restart(server: FakeSGLangServer, **kwargs) -> FakeSGLangServer:
    await server.stop()
    fresh = fake(**kwargs)
    await fresh.start(port=server.port)
    return fresh


def generated_at(server: FakeSGLangServer) -> int:
    return sum(p == "/generate" for p, _ in server.requests)


def test_a_restarted_servers_stale_answers_are_dropped_and_it_rejoins_the_next_sync():
    async def main():
        a, b = fake(), fake()
        async with client([await a.start(), await b.start()]) as engine:
            sync = ws.TensorWeightSync(engine)
            await sync.start()
            assert await sync.update(BUCKETS) == 1
            b = await restart(b)  # back at "default": it missed version 1
            during = [await engine.generate([1, 2], PARAMS) for _ in range(4)]
            stale, at_b = engine.stale_responses, generated_at(b)
            assert await sync.update(BUCKETS) == 2  # b is updated with a: it serves again
            after = [await engine.generate([1, 2], PARAMS) for _ in range(4)]
        await a.stop()
        await b.stop()
        return a, b, during, stale, at_b, after, engine

    a, b, during, stale, at_b, after, engine = run(main())
    assert stale == 1 and at_b == 1  # its one answer was dropped, then it got no work
    assert all(g.finish_reason is FinishReason.LENGTH and g.versions == [1, 1, 1] and g.meta["server"] == a.url
               for g in during)
    assert all(g.versions == [2, 2, 2] for g in after)
    assert {g.meta["server"] for g in after} == {a.url, b.url} and b.weight_version == "2"
    assert engine.stale_responses == 1 and not any(s.stale for s in engine.pool.servers)


def test_a_stale_answer_with_no_other_server_is_flagged_not_returned_as_fresh():
    async def main():
        a = fake()
        async with client([await a.start()]) as engine:
            sync = ws.TensorWeightSync(engine)
            await sync.start()
            await sync.update(BUCKETS)
            a = await restart(a)
            out = await engine.generate([1, 2], PARAMS)
            later = await engine.generate([1, 2], PARAMS)  # no fresh server: nothing is sent
        await a.stop()
        return out, later, generated_at(a), engine.stale_responses

    out, later, sent, stale = run(main())
    assert out.finish_reason is FinishReason.ABORT and out.meta["stale"] and out.token_ids == []
    assert later.finish_reason is FinishReason.ABORT and sent == 1 and stale == 1


def test_a_health_check_that_finds_a_restarted_server_reads_its_version_before_giving_it_work():
    async def main():
        a, b = fake(), fake()
        async with client([await a.start(), await b.start()], health_timeout_s=3.0) as engine:
            a.health_generation = b.health_generation = False
            sync = ws.TensorWeightSync(engine)
            await sync.start()
            await sync.update(BUCKETS)
            await b.stop()
            down = await engine.check_health()
            b = await restart(b)
            b.health_generation = False
            up = await engine.check_health()
            outs = [await engine.generate([1, 2], PARAMS) for _ in range(3)]
        await a.stop()
        await b.stop()
        return a, b, down, up, outs, engine

    a, b, down, up, outs, engine = run(main())
    assert down[b.url] is False and up[b.url] is True
    assert engine.pool.servers[1].stale and generated_at(b) == 0 and engine.stale_responses == 0
    assert all(g.meta["server"] == a.url and g.versions == [1, 1, 1] for g in outs)


def test_a_server_later_than_the_rejoin_wait_is_left_out_and_the_next_sync_brings_it_back():
    """The old rule waited a fixed 120 s for every server and then failed the sync (a 32B restart
    takes 3-6 min). Here the wait is 0.5 s and the server comes back after it (after the sync):
    the sync goes on with the other server, the late one gets no work, and the next sync finds it
    back at its launch weights and brings it to the current version."""
    async def main():
        a, b = fake(), fake()
        async with client([await a.start(), await b.start()], rejoin_timeout_s=0.5) as engine:
            sync = ws.TensorWeightSync(engine)
            await sync.start()
            assert await sync.update(BUCKETS) == 1
            port = b.port
            await b.stop()  # restarting: not back before the sync
            tic = time.monotonic()
            version = await asyncio.wait_for(sync.update(BUCKETS), 30)
            took = time.monotonic() - tic
            left_out = [s.url for s in engine.pool.servers if s.stale and not s.healthy]
            b = fake()
            await b.start(port=port)  # back, at "default" (after the wait)
            await engine.check_health()
            between = [await engine.generate([1, 2], PARAMS) for _ in range(4)]
            at_b = generated_at(b)
            again = await sync.update(BUCKETS)
            after = [await engine.generate([1, 2], SamplingParams(max_new_tokens=3, route_key=f"k{i}"))
                     for i in range(6)]
        await a.stop()
        await b.stop()
        return a, b, version, took, left_out, between, at_b, again, after, engine

    a, b, version, took, left_out, between, at_b, again, after, engine = run(main())
    assert version == 2 and 0.4 < took < 5 and a.weight_version == "3" and left_out == [b.url]
    assert at_b == 0 and all(g.meta["server"] == a.url and g.versions == [2, 2, 2] for g in between)
    assert again == 3 and b.weight_version == "3" and engine.stale_responses == 0
    assert {g.meta["server"] for g in after} == {a.url, b.url} and all(g.versions == [3, 3, 3] for g in after)
    assert not any(s.stale for s in engine.pool.servers)


def test_no_server_answering_fails_the_sync_after_the_restart_wait_naming_them():
    async def main():
        a, b = fake(), fake()
        async with client([await a.start(), await b.start()], rejoin_timeout_s=0.2, restart_timeout_s=1.0) as engine:
            sync = ws.TensorWeightSync(engine)
            await sync.start()
            await sync.update(BUCKETS)
            await a.stop()
            await b.stop()  # and nothing restarts them
            tic = time.monotonic()
            with pytest.raises(SGLangError) as caught:
                await asyncio.wait_for(sync.update(BUCKETS), 30)
            took = time.monotonic() - tic
        return a, b, str(caught.value), took

    a, b, message, took = run(main())
    assert a.url in message and b.url in message and "no SGLang server answered within 1s" in message
    assert 0.9 < took < 5
    assert not any(p == "/pause_generation" for p, _ in a.requests[-3:])  # refused before pausing anyone


def test_the_restart_wait_follows_the_checkpoint_size(tmp_path, tiny_qwen2):
    from megatron_tir.rollout.engines.sglang.client import MIN_RESTART_WAIT_S, checkpoint_bytes, load_wait_s
    from megatron_tir.rollout.factory import EngineConfig, engine_settings

    (tmp_path / "model-00001.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "model-00002.safetensors").write_bytes(b"x" * 24)
    (tmp_path / "config.json").write_text("{}")
    assert checkpoint_bytes(tmp_path) == 1024

    assert load_wait_s(0) == MIN_RESTART_WAIT_S
    assert 6 * 60 < load_wait_s(int(65.5e9)) < 12 * 60  # Qwen2.5-32B in bf16: 3-6 min to load and capture
    assert load_wait_s(int(65.5e9)) == pytest.approx(2 * (65.5e9 / 0.5e9 + 120))  # hand-computed: 502 s
    assert load_wait_s(int(65.5e9)) > load_wait_s(int(15.2e9))
    with pytest.raises(ValueError, match="restart_timeout_s"):
        client(["http://127.0.0.1:1"], restart_timeout_s=0)
    settings = engine_settings(EngineConfig(kind="sglang", urls=("http://127.0.0.1:1",)), tiny_qwen2)
    assert settings.restart_timeout_s == load_wait_s(checkpoint_bytes(tiny_qwen2)) == MIN_RESTART_WAIT_S
    assert checkpoint_bytes(tiny_qwen2) > 0


def test_a_colocated_server_restarted_between_offload_and_the_sync_is_not_resumed_and_rejoins():
    """After ``offload()`` every server has released its memory; one that restarts before the sync
    holds nothing released, and resuming a tag there would kill it (fake rule 4, SGLang's
    ``offload_tags.remove``): the sync resumes only the servers that released, updates all."""
    async def main():
        a, b = fake(enable_memory_saver=True), fake(enable_memory_saver=True)
        async with client([await a.start(), await b.start()]) as engine:
            sync = ws.TensorWeightSync(engine)
            await sync.start()
            assert await sync.update(BUCKETS) == 1
            await sync.offload()
            assert a.memory_released == b.memory_released == {"weights", "kv_cache", "cuda_graph"}
            b = await restart(b, enable_memory_saver=True)  # the agent restarted it while the trainer trained
            version = await sync.update(BUCKETS)
            outs = [await engine.generate([1, 2], SamplingParams(max_new_tokens=3, route_key=f"k{i}"))
                    for i in range(6)]
            await sync.offload()  # the next step: both release again, both resume
            again = await sync.update(BUCKETS)
        await a.stop()
        await b.stop()
        return a, b, version, again, outs

    a, b, version, again, outs = run(main())
    assert version == 2 and again == 3 and a.crashed is None and b.crashed is None
    assert not a.memory_released and not b.memory_released and a.weight_version == b.weight_version == "3"
    resumed_on_b = [body["tags"] for p, body in b.requests if p == "/resume_memory_occupation"]
    assert resumed_on_b == [["weights"], ["kv_cache", "cuda_graph"]]  # the second step's only
    assert {g.meta["server"] for g in outs} == {a.url, b.url} and all(g.versions == [2, 2, 2] for g in outs)

"""The SGLang client against what a real sglang 0.5.23 server does, one rule per test.

The fake server (fake_sglang.py) enforces the rules the way the real server does; its
docstring cites the sglang source of each. The weight-sync rules that need a real
broadcast are in test_weight_sync.py.
"""

from __future__ import annotations

import asyncio
import sys
import time

import pytest
from engine_testing import run, until_sampling
from fake_sglang import FakeSGLangServer, RadixCache, tcp_address
from fake_sglang_backend import local_engine_handler, serve_in_thread
from sglang_schema import api_types
from megatron_tir.ports import free_port
from sglang_testing import canned_response, client, scripted, unreachable_url

from megatron_tir.rollout.sync.sglang import (
    DistributedWeightSync,
    DistributedWeightSyncConfig,
    serialize_for_tp_ranks,
    tcp_init_method,
)
from megatron_tir.rollout.engines.base import FinishReason, PauseMode, SamplingParams
from megatron_tir.rollout.engines.sglang import SGLangError, SGLangServer, SGLangServerConfig, parse_generate_response
from megatron_tir.rollout.engines.sglang.pool import ServerPool

PARAMS = SamplingParams(max_new_tokens=3)


def held(release: asyncio.Event):
    """A /generate handler that runs until ``release`` is set."""
    async def handle(req, body):
        await release.wait()
        return canned_response(req)
    return handle


# ---------------------------------------------------------------------- 1. weight-update session


def test_1_weight_updates_only_inside_a_session():
    async def main():
        server = FakeSGLangServer(scripted(canned_response))
        async with client([await server.start()]) as engine:
            await engine.init_weights_update_group(master_address="10.0.0.1", master_port=29500, group_name="g")
            update = dict(names=["model.norm.weight"], dtypes=["float32"], shapes=[[64]], group_name="g")
            with pytest.raises(SGLangError, match="400.*must run between begin_weight_update"):
                await engine.update_weights_from_distributed(**update)
            with pytest.raises(SGLangError, match="400.*update_weights_from_tensor must run between"):
                await engine.update_weights_from_tensor([["YWJj"]])
            await engine.begin_weight_update()
            with pytest.raises(SGLangError, match="already open"):
                await engine.begin_weight_update()
            await engine.update_weights_from_distributed(**update, weight_version="7")
            await engine.end_weight_update()
            with pytest.raises(SGLangError, match="no weight-update session is open"):
                await engine.end_weight_update()
        await server.stop()
        return server

    server = run(main())
    assert server.weight_version == "7"
    sent = [b for p, b in server.requests if p == "/update_weights_from_distributed"]
    assert all(b["flush_cache"] is False for b in sent)  # the sync flushes once, after end_weight_update


# ---------------------------------------------------------------------- 2. EOS ids


def test_2_the_clients_eos_ids_are_sent_as_stop_token_ids(make_engine, tiny_llama):
    """The server stops on its model's EOS only; the client's extra EOS id must travel."""
    async def main():
        backend = make_engine(tiny_llama, eos_token_ids=(0,))
        prompt = backend.tokenizer("Hello").input_ids
        free = await backend.generate(prompt, SamplingParams(max_new_tokens=20, seed=4))
        server = FakeSGLangServer(local_engine_handler(backend), engine=backend)
        extra = free.token_ids[3]
        async with client([await server.start()], eos_token_ids=(0, extra)) as engine:
            out = await engine.generate(prompt, SamplingParams(max_new_tokens=20, seed=4))
        await server.stop()
        await backend.close()
        return free, extra, out, server

    free, extra, out, server = run(main())
    first = free.token_ids.index(extra)
    assert out.finish_reason is FinishReason.EOS and out.token_ids == free.token_ids[: first + 1]
    assert "matched_token_id" not in out.meta  # the server reports one of the client's own EOS ids
    assert server.requests[0][1]["sampling_params"]["stop_token_ids"] == sorted({0, extra})


# ---------------------------------------------------------------------- 3. health while paused


def test_3_servers_stay_up_through_a_pause():
    """/health waits while generation is paused; the client must not mark servers down for it."""
    async def main():
        servers = [FakeSGLangServer(scripted(canned_response)) for _ in range(2)]
        urls = [await s.start() for s in servers]
        async with client(urls, health_check_interval_s=0.2, health_timeout_s=1.5) as engine:
            await engine.wait_healthy(timeout_s=10, poll_s=0.1)
            await engine.pause(mode=PauseMode.ABORT)
            await asyncio.sleep(2.5)  # longer than one health probe may take
            during = [s.healthy for s in engine.pool.servers]
            await engine.resume()
            out = await engine.generate([1, 2], PARAMS)
            up = [s.healthy for s in engine.pool.servers]
        for s in servers:
            await s.stop()
        return during, out, up

    during, out, up = run(main())
    assert during == [True, True]
    assert out.finish_reason is FinishReason.LENGTH and up == [True, True]


def test_3_a_server_that_died_during_the_pause_is_down_after_resume():
    async def main():
        alive, dying = FakeSGLangServer(scripted(canned_response)), FakeSGLangServer(scripted(canned_response))
        urls = [await alive.start(), await dying.start()]
        async with client(urls) as engine:
            await engine.pause()
            await dying.stop()
            await engine.resume()  # the live server takes the requests
            outs = [await engine.generate([1], PARAMS) for _ in range(3)]
            up = [s.healthy for s in engine.pool.servers]
            await alive.stop()
            with pytest.raises(SGLangError, match="continue_generation"):
                await engine.resume()
        return urls, outs, up

    urls, outs, up = run(main())
    assert up == [True, False] and all(o.meta["server"] == urls[0] for o in outs)


# ---------------------------------------------------------------------- 4. memory release / resume


def test_4_release_only_while_paused_and_resume_exactly_what_was_released():
    async def main():
        release = asyncio.Event()
        server = FakeSGLangServer(held(release), enable_memory_saver=True)
        async with client([await server.start()]) as engine:
            running = asyncio.create_task(engine.generate([1, 2], PARAMS))
            await asyncio.sleep(0.1)
            with pytest.raises(RuntimeError, match="needs pause\\(\\) first"):  # it would kill the scheduler
                await engine.release_memory_occupation(["kv_cache"])
            release.set()
            await running
            await engine.pause(mode=PauseMode.RETRACT)
            await engine.release_memory_occupation(["kv_cache"])
            freed = set(server.memory_freed)
            await engine.resume_memory_occupation()  # no tags: exactly the released ones
            await engine.resume()
            out = await engine.generate([1, 2], PARAMS)
        await server.stop()
        return server, freed, out

    server, freed, out = run(main())
    assert server.crashed is None and freed == {"kv_cache"} and server.memory_released == set()
    assert [b["tags"] for p, b in server.requests if p.endswith("memory_occupation")] == [["kv_cache"], ["kv_cache"]]
    assert out.finish_reason is FinishReason.LENGTH


def test_4_a_server_without_the_memory_saver_is_refused_and_colocated_launches_with_it():
    async def main():
        server = FakeSGLangServer(scripted(canned_response))
        async with client([await server.start()]) as engine:
            await engine.pause()
            with pytest.raises(SGLangError, match="without --enable-memory-saver"):
                await engine.release_memory_occupation()
            await engine.resume()
        await server.stop()

    run(main())
    assert "--enable-memory-saver" in SGLangServerConfig(model_path="/m", colocated=True).argv()
    assert "--enable-memory-saver" not in SGLangServerConfig(model_path="/m").argv()
    with pytest.raises(ValueError, match="colocated server needs enable_memory_saver"):
        SGLangServerConfig(model_path="/m", colocated=True, enable_memory_saver=False)


# ---------------------------------------------------------------------- 5. flush


@pytest.mark.parametrize("mode", [PauseMode.ABORT, PauseMode.RETRACT])
def test_5_flush_right_after_a_pause(make_engine, tiny_llama, mode):
    """After an abort the scheduler still holds the batch for a moment (400); after a retract
    it holds the retracted requests, which only the immediate form ignores."""
    async def main():
        backend = make_engine(tiny_llama, eos_token_ids=(0,))
        server = FakeSGLangServer(local_engine_handler(backend), engine=backend)
        async with client([await server.start()], flush_timeout_s=10) as engine:
            task = asyncio.create_task(engine.generate([1, 2, 3], SamplingParams(max_new_tokens=500, seed=1)))
            await until_sampling(backend)  # the pause lands mid-request (a 0.3 s sleep raced a loaded machine)
            await engine.pause(mode=mode)
            t0 = time.perf_counter()
            await engine.flush_cache()
            seconds = time.perf_counter() - t0
            await engine.resume()
            out = await task
        await server.stop()
        await backend.close()
        return out, seconds

    out, seconds = run(main())
    assert seconds < 5
    assert out.finish_reason is (FinishReason.ABORT if mode is PauseMode.ABORT else FinishReason.LENGTH)


# ---------------------------------------------------------------------- 6. routing


def test_6_pool_is_sticky_per_key_and_falls_back_when_a_server_is_down():
    pool = ServerPool(["http://a", "http://b", "http://c"], max_keys=2)
    a, b, c = pool.servers
    assert pool.pick(key="t1") is a and pool.pick(key="t2") is b
    a.in_flight = 5
    assert pool.pick(key="t1") is a  # sticky even when busier
    pool.mark_down(a, "test")
    moved = pool.pick(key="t1")
    assert moved in (b, c)
    pool.mark_up(a)
    assert pool.pick(key="t1") is moved  # the key stays where it moved
    assert pool.pick(exclude=[moved], key="t1") not in (moved, None)  # a failed server is left
    pool.pick(key="t3")  # the table keeps the 2 most recent keys
    assert "t2" not in pool._affinity and set(pool._affinity) == {"t1", "t3"}


def multi_turn_hit_rate(n_servers: int, keyed: bool, *, trajectories: int = 12, turns: int = 4) -> float:
    """cached_tokens / prompt tokens over multi-turn trajectories (each turn = context + output + feedback)."""
    async def answer(req, body):  # 8 output ids that depend on the context, after a varying time
        seed = sum(req.input_ids) % 997
        await asyncio.sleep((seed % 7) / 200)
        return canned_response(req, ids=tuple(100 + (seed * (i + 3)) % 50 for i in range(8)))

    async def main():
        servers = [FakeSGLangServer(answer) for _ in range(n_servers)]
        urls = [await s.start() for s in servers]
        async with client(urls) as engine:
            async def trajectory(t: int) -> None:
                context = [10 + t] * 40  # no prefix shared across trajectories
                for turn in range(turns):
                    params = SamplingParams(max_new_tokens=8, route_key=f"traj-{t}" if keyed else None)
                    out = await engine.generate(context, params)
                    context = context + out.token_ids + [7, 7, 7 + turn]  # tool feedback
            await asyncio.gather(*(trajectory(t) for t in range(trajectories)))
        for s in servers:
            await s.stop()
        cached = sum(c for s in servers for c, _ in s.cached_tokens)
        prompt = sum(p for s in servers for _, p in s.cached_tokens)
        return cached / prompt

    return run(main())


def test_6_sticky_routing_keeps_the_prefix_cache_with_several_servers():
    one = multi_turn_hit_rate(1, keyed=False)
    keyed = multi_turn_hit_rate(4, keyed=True)
    unkeyed = multi_turn_hit_rate(4, keyed=False)
    assert keyed == pytest.approx(one)  # every continuation finds its trajectory's prefix
    assert keyed > 0.7 and unkeyed < keyed - 0.05  # least-in-flight scatters continuations


def test_6_radix_model_matches_at_most_all_but_one_token():
    cache = RadixCache()
    cache.insert([1, 2, 3, 4])
    assert cache.match([1, 2, 3, 4]) == 3 and cache.match([1, 2, 9]) == 2 and cache.match([5]) == 0
    cache.reset()
    assert cache.match([1, 2, 3]) == 0


# ---------------------------------------------------------------------- 7. connections


def test_7_an_idle_connection_is_not_reused_after_the_servers_keepalive():
    """The server closes idle connections after 5 s; a loop busy past that must not reuse one."""
    server, stop = serve_in_thread(lambda: FakeSGLangServer(scripted(canned_response)))

    async def main():
        async with client([server.url]) as engine:
            first = await engine.generate([1], PARAMS)
            time.sleep(5.5)  # the event loop is busy (a long step): the server's close goes unseen
            second = await engine.generate([1], PARAMS)
        return first, second

    try:
        first, second = run(main())
    finally:
        stop()
    assert first.finish_reason is second.finish_reason is FinishReason.LENGTH, second.meta


def test_7_a_connect_timeout_is_retried_on_another_server():
    async def main():
        live = FakeSGLangServer(scripted(canned_response))
        with unreachable_url() as dead:
            async with client([dead, await live.start()], connect_timeout_s=0.5) as engine:
                engine.pool.servers[1].in_flight = 1  # the dead server is picked first
                out = await engine.generate([1], PARAMS)
                dead_state = engine.pool.servers[0]
        await live.stop()
        return out, dead_state

    out, dead_state = run(main())
    assert out.finish_reason is FinishReason.LENGTH
    assert not dead_state.healthy and "ConnectionTimeoutError" in dead_state.last_error


# ---------------------------------------------------------------------- 8. process-group checks


def test_8_dp_size_and_tp_sizes_come_from_server_info():
    async def main():
        replicated = FakeSGLangServer(scripted(canned_response), dp_size=2)
        async with client([await replicated.start()]) as engine:
            sync = DistributedWeightSync(engine, DistributedWeightSyncConfig(master_address="127.0.0.1",
                                                                             master_port=free_port(), backend="gloo"))
            with pytest.raises(SGLangError, match="dp_size=2"):
                await sync.start()
        await replicated.stop()
        mixed = [FakeSGLangServer(scripted(canned_response), tp_size=tp) for tp in (2, 1)]
        async with client([await s.start() for s in mixed]) as engine:
            world = await engine.init_weights_update_group(master_address="::1", master_port=29500, group_name="g")
        for s in mixed:
            await s.stop()
        return replicated, mixed, world

    replicated, mixed, world = run(main())
    assert "/init_weights_update_group" not in [p for p, _ in replicated.requests]
    assert world == 4 and [s.requests[-1][1]["rank_offset"] for s in mixed] == [1, 3]
    assert not any(s.contract_errors for s in mixed)


def test_8_ipv6_master_addresses_are_bracketed():
    assert tcp_init_method("::1", 29500) == "tcp://[::1]:29500" == tcp_address("::1", 29500)
    assert tcp_init_method("fe80::1", 1) == "tcp://[fe80::1]:1"
    assert tcp_init_method("10.0.0.5", 2) == "tcp://10.0.0.5:2" and tcp_init_method("node-3", 2) == "tcp://node-3:2"


def test_8_a_failed_join_stops_the_wait_at_once():
    async def main():
        servers = [FakeSGLangServer(scripted(canned_response), join_wait_s=30),  # waits for the other ranks
                   FakeSGLangServer(scripted(canned_response), init_failure="NCCL error: unhandled system error")]
        async with client([await s.start() for s in servers]) as engine:
            sync = DistributedWeightSync(engine, DistributedWeightSyncConfig(
                master_address="127.0.0.1", master_port=free_port(), backend="gloo", timeout_s=60))
            t0 = time.perf_counter()
            with pytest.raises(SGLangError, match="Failed to initialize custom process group: NCCL error"):
                await sync.start()
            seconds = time.perf_counter() - t0
        for s in servers:
            await s.stop()
        return seconds

    assert run(main()) < 10  # not the 60 s join timeout


# ---------------------------------------------------------------------- 9. update_weights_from_tensor


def test_9_one_tensor_payload_per_tp_rank_and_cuda_only():
    import torch

    async def main():
        server = FakeSGLangServer(scripted(canned_response), tp_size=2)
        async with client([await server.start()]) as engine:
            await engine.begin_weight_update()
            with pytest.raises(ValueError, match="tp_size 2, got 1 serialized payloads"):  # the server would die
                await engine.update_weights_from_tensor([["YWJj"]])
            await engine.update_weights_from_tensor([["YWJj", "ZGVm"]], weight_version="2")
            await engine.end_weight_update()
        await server.stop()
        return server

    server = run(main())
    assert server.crashed is None and server.weight_version == "2"
    with pytest.raises(ValueError, match="not on a GPU"):
        serialize_for_tp_ranks([("w", torch.zeros(2))], 2)


# ---------------------------------------------------------------------- 10. weight versions


def test_10_weight_version_spans_are_kept_in_meta():
    types = api_types()
    req = types.GenerateRequest(rid="r", input_ids=[1, 2])
    body = canned_response(req).to_json_value()
    body["meta_info"]["weight_version"] = "2"
    body["meta_info"]["weight_versions"] = [{"version": "1", "start": 0, "end": 2}, ["2", 2, 3]]
    out = parse_generate_response(body, prompt_tokens=2, eos_token_ids=(0,))
    assert out.meta["weight_version"] == "2"
    assert out.meta["weight_versions"] == [{"version": "1", "start": 0, "end": 2},
                                           {"version": "2", "start": 2, "end": 3}]
    body["meta_info"]["weight_versions"] = [{"version": "1", "start": 0, "end": 9}]
    with pytest.raises(SGLangError, match="out of range for 3 tokens"):
        parse_generate_response(body, prompt_tokens=2, eos_token_ids=(0,))


def test_10_each_token_gets_the_version_of_its_span():
    types = api_types()
    body = canned_response(types.GenerateRequest(rid="r", input_ids=[1, 2])).to_json_value()
    body["meta_info"]["weight_versions"] = [{"version": "1", "start": 0, "end": 2}, ["2", 2, 3]]
    assert parse_generate_response(body, prompt_tokens=2, eos_token_ids=(0,)).versions == [1, 1, 2]
    body["meta_info"]["weight_versions"] = [{"version": "default", "start": 0, "end": 3}]
    assert parse_generate_response(body, prompt_tokens=2, eos_token_ids=(0,)).versions == [0, 0, 0]
    body["meta_info"]["weight_versions"] = [{"version": "1", "start": 0, "end": 1}, ["2", 2, 3]]
    with pytest.raises(SGLangError, match="do not cover the 3 tokens"):
        parse_generate_response(body, prompt_tokens=2, eos_token_ids=(0,))
    body["meta_info"]["weight_versions"] = [{"version": "policy-v3", "start": 0, "end": 3}]
    with pytest.raises(SGLangError, match="neither 'default' nor a non-negative integer"):
        parse_generate_response(body, prompt_tokens=2, eos_token_ids=(0,))
    del body["meta_info"]["weight_versions"]
    body["meta_info"]["weight_version"] = "5"
    assert parse_generate_response(body, prompt_tokens=2, eos_token_ids=(0,)).versions == [5, 5, 5]
    del body["meta_info"]["weight_version"]
    with pytest.raises(SGLangError, match="no weight_version"):
        parse_generate_response(body, prompt_tokens=2, eos_token_ids=(0,))


def test_10_the_client_reads_the_live_version_from_model_info_and_records_the_ones_it_sets():
    async def main():
        server = FakeSGLangServer(scripted(canned_response))
        async with client([await server.start()]) as engine:
            start = engine.weight_version, await engine.fetch_weight_version()
            await engine.begin_weight_update()
            await engine.update_weights_from_tensor([["YWJj"]], weight_version="4")
            await engine.end_weight_update()
            set_ = engine.weight_version
            server.weight_version = "6"  # another trainer moved it
            fetched = await engine.fetch_weight_version()
            out = await engine.generate([1, 2], PARAMS)
            with pytest.raises(SGLangError, match="neither 'default'"):
                await engine.update_weights_from_tensor([["YWJj"]], weight_version="v7")
        await server.stop()
        return start, set_, fetched, out, server

    start, set_, fetched, out, server = run(main())
    assert start == (0, 0) and set_ == 4 and fetched == 6
    assert out.versions == [6, 6, 6] and out.meta["weight_version"] == "6"
    assert ("/model_info", None) in server.requests and not server.contract_errors


# ---------------------------------------------------------------------- 11. wait_healthy


def test_11_wait_healthy_allows_the_one_second_health_probe():
    port = free_port()
    server, stop = serve_in_thread(lambda: FakeSGLangServer(scripted(canned_response)), port=port)
    cfg = SGLangServerConfig(model_path="/m", port=port,
                             launcher=(sys.executable, "-c", "import time; time.sleep(60)"))
    launched = SGLangServer(cfg).start()
    try:
        t0 = time.perf_counter()
        launched.wait_healthy(timeout_s=8, poll_s=0.2)
        seconds = time.perf_counter() - t0
    finally:
        launched.stop(grace_s=5)
        stop()
    assert 0.9 < seconds < 5

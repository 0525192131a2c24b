"""SGLangEngine (HTTP client) against fake servers held to SGLang 0.5.x's own schema.

The fakes validate every body with sglang/api/v1/api_types.py (``/generate``) or the
request classes of sglang/srt/managers/io_struct.py (control endpoints), answer with
api_types structs, and generate with a real LocalEngine -- so an SGLangEngine answer can
be compared with the local engine's for the same seeds.
"""

from __future__ import annotations

import asyncio

import pytest
from megatron_tir.rollout.engines.base import (
    ContextTooLong,
    FinishReason,
    GenerationEngine,
    SamplingParams,
)
from megatron_tir.rollout.engines.sglang import (
    SGLangEngine,
    SGLangEngineConfig,
    SGLangError,
    build_generate_request,
    parse_generate_response,
)

from engine_testing import protocol_mismatches, run, until, until_sampling
from fake_sglang import DROP_CONNECTION, FakeSGLangServer
from fake_sglang_backend import local_engine_handler
from sglang_schema import api_types
from megatron_tir.ports import free_port
from sglang_testing import EOS, canned_response, client, scripted


def test_engine_matches_the_protocol_signatures():
    assert protocol_mismatches(SGLangEngine, GenerationEngine) == []


# ---------------------------------------------------------------------- wire format


def test_generate_request_is_valid_for_sglangs_schema():
    types = api_types()
    params = SamplingParams(max_new_tokens=64, temperature=0.7, top_p=0.9, top_k=20, stop=("```\n", "</answer>"),
                            seed=42)
    body = build_generate_request([1, 2, 3], params, rid="abc")
    req = types.GenerateRequest.from_json_value(body)  # the server's own contract gate
    sp = req.sampling_params
    assert req.input_ids == [1, 2, 3] and req.return_logprob is True and req.rid == "abc"
    assert (sp.max_new_tokens, sp.temperature, sp.top_p, sp.top_k) == (64, 0.7, 0.9, 20)
    assert sp.stop == ["```\n", "</answer>"] and sp.sampling_seed == 42
    assert sp.no_stop_trim is True and sp.skip_special_tokens is False
    minimal = types.GenerateRequest.from_json_value(build_generate_request([9], SamplingParams(max_new_tokens=1),
                                                                           rid="r"))
    assert minimal.sampling_params.stop is None and minimal.sampling_params.top_k == -1


@pytest.mark.parametrize("finish,expected,matched", [
    ("stop_str", FinishReason.STOP, "```\n"),
    ("stop_eos", FinishReason.EOS, None),
    ("stop_tokens", FinishReason.EOS, None),
    ("length", FinishReason.LENGTH, None),
    ("abort", FinishReason.ABORT, None),
])
def test_finish_reasons_parse(finish, expected, matched):
    types = api_types()
    reason = {"stop_str": types.FinishStop(matched="```\n"), "stop_eos": types.FinishStop(matched=0),
              "stop_tokens": types.FinishStop(matched=[0]), "length": types.FinishLength(length=3),
              "abort": types.FinishAbort(message="Abort before prefill", status_code=None)}[finish]
    req = types.GenerateRequest(rid="r", input_ids=[1, 2])
    body = canned_response(req, finish=reason).to_json_value()
    out = parse_generate_response(body, prompt_tokens=2, eos_token_ids=EOS, server="s")
    assert out.finish_reason is expected and out.matched_stop == matched
    assert out.token_ids == [5, 6, 7] and out.logprobs == [-0.5, -1.0, -1.5] and out.prompt_tokens == 2
    if finish == "abort":
        assert out.meta["abort_message"] == "Abort before prefill"


@pytest.mark.parametrize("mutate,message", [
    (lambda b: b.pop("meta_info"), "no meta_info"),
    (lambda b: b["meta_info"].pop("output_token_logprobs"), "output_token_logprobs missing"),
    (lambda b: b["meta_info"]["output_token_logprobs"][1].__setitem__(0, None), "has no log-prob"),
    (lambda b: b["meta_info"]["output_token_logprobs"].__setitem__(0, [0.1, 5]), "not \\[logprob, token_id, text\\]"),
    (lambda b: b.__setitem__("output_ids", [5, 6]), "disagree"),
    (lambda b: b["meta_info"].__setitem__("finish_reason", {"type": "exploded"}), "unknown finish_reason"),
    (lambda b: b["meta_info"].__setitem__("finish_reason", None), "finish_reason is not an object"),
    (lambda b: b["meta_info"].__setitem__("finish_reason", {"type": "stop"}), "no usable 'matched'"),
    (lambda b: b["meta_info"].__setitem__("prompt_tokens", 7), "prompt_tokens 7"),
])
def test_bad_responses_raise_clear_errors(mutate, message):
    types = api_types()
    body = canned_response(types.GenerateRequest(rid="r", input_ids=[1, 2])).to_json_value()
    mutate(body)
    with pytest.raises(SGLangError, match=message):
        parse_generate_response(body, prompt_tokens=2, eos_token_ids=EOS, server="http://x")
    with pytest.raises(SGLangError, match="expected a JSON object"):
        parse_generate_response([1], prompt_tokens=2, eos_token_ids=EOS)


# ---------------------------------------------------------------------- against fake servers


def test_sglang_engine_matches_the_local_engine_through_the_schema(make_engine, tiny_llama):
    """Same seeds through two schema-checking servers == the local engine called directly."""
    specs = [("def add(a, b):", SamplingParams(max_new_tokens=12, temperature=1.0, seed=1)),
             ("The capital of France is", SamplingParams(max_new_tokens=30, temperature=0.8, top_p=0.9, seed=2)),
             ("x", SamplingParams(max_new_tokens=8, temperature=0.0)),
             ("Question:", SamplingParams(max_new_tokens=40, seed=3, stop=(" ",)))]

    async def main():
        reference = make_engine(tiny_llama, eos_token_ids=(0,))
        prompts = [reference.tokenizer(t).input_ids for t, _ in specs]
        expected = [await reference.generate(p, sp) for p, (_, sp) in zip(prompts, specs)]
        await reference.close()
        backends = [make_engine(tiny_llama, eos_token_ids=(0,)) for _ in range(2)]
        servers = [FakeSGLangServer(local_engine_handler(b), engine=b) for b in backends]
        urls = [await s.start() for s in servers]
        async with client(urls) as engine:
            got = await asyncio.gather(*(engine.generate(p, sp) for p, (_, sp) in zip(prompts, specs)))
        for s, b in zip(servers, backends):
            await s.stop()
            await b.close()
        return prompts, expected, got, servers

    prompts, expected, got, servers = run(main())
    assert not any(s.contract_errors for s in servers)
    assert sum(len(s.requests) for s in servers) == len(specs)
    assert {r.finish_reason for r in expected} >= {FinishReason.LENGTH, FinishReason.STOP}
    for want, have in zip(expected, got):
        assert have.token_ids == want.token_ids  # log-probs: batched on the servers, serial here
        assert have.logprobs == pytest.approx(want.logprobs, abs=1e-4)
        assert have.finish_reason is want.finish_reason and have.matched_stop == want.matched_stop
        assert have.meta["server"] in [s.url for s in servers]
    for path, body in (r for s in servers for r in s.requests):
        assert path == "/generate" and body["return_logprob"] is True
        assert body["sampling_params"]["no_stop_trim"] is True and body["sampling_params"]["skip_special_tokens"] is False


def test_eos_from_the_server_maps_to_eos(make_engine, tiny_llama):
    async def main():
        backend = make_engine(tiny_llama, eos_token_ids=(0,))
        prompt = backend.tokenizer("Hello").input_ids
        free = await backend.generate(prompt, SamplingParams(max_new_tokens=20, seed=4))
        await backend.close()
        backend = make_engine(tiny_llama, eos_token_ids=(free.token_ids[3],))  # the server's EOS id
        server = FakeSGLangServer(local_engine_handler(backend), engine=backend)
        url = await server.start()
        async with client([url]) as engine:
            out = await engine.generate(prompt, SamplingParams(max_new_tokens=20, seed=4))
        await server.stop()
        await backend.close()
        return free, out, server

    free, out, server = run(main())
    first = free.token_ids.index(free.token_ids[3])
    assert out.finish_reason is FinishReason.EOS and out.token_ids == free.token_ids[: first + 1]
    assert out.meta.get("matched_token_id") == free.token_ids[3]  # not one of the client's own EOS ids
    assert not server.contract_errors


def test_retry_away_from_a_dead_server_and_a_503():
    async def main():
        live = FakeSGLangServer(scripted(canned_response))
        failing = FakeSGLangServer(scripted((503, {"error": {"message": "server is shutting down"}})))
        urls = [f"http://127.0.0.1:{free_port()}", await failing.start(), await live.start()]
        async with client(urls) as engine:
            outs = await asyncio.gather(*(engine.generate([1, 2], SamplingParams(max_new_tokens=3))
                                          for _ in range(6)))
            health = {s.url: s.healthy for s in engine.pool.servers}
        await live.stop()
        await failing.stop()
        return urls, outs, health, live, failing

    urls, outs, health, live, failing = run(main())
    assert all(o.finish_reason is FinishReason.LENGTH and o.token_ids == [5, 6, 7] for o in outs)
    assert all(o.meta["server"] == live.url for o in outs)
    assert len(live.requests) == 6 and len(failing.requests) >= 1
    assert health == {urls[0]: False, urls[1]: False, urls[2]: True}


def test_no_retry_once_the_request_was_sent():
    """A connection lost after sending returns ABORT (the server may still be generating)."""
    async def drop(req, body):
        return DROP_CONNECTION

    async def main():
        dropper = FakeSGLangServer(drop)
        async with client([await dropper.start()]) as engine:
            out = await engine.generate([1], SamplingParams(max_new_tokens=3))
        await dropper.stop()
        return out, dropper

    out, dropper = run(main())
    assert out.finish_reason is FinishReason.ABORT and out.token_ids == [] and "error" in out.meta
    assert len(dropper.requests) == 1


def test_4xx_is_a_value_error_and_all_down_is_an_sglang_error():
    async def main():
        rejecting = FakeSGLangServer(scripted((400, {"error": {"message": "The input (9000 tokens) is longer than"
                                                                          " the model's context length"}})))
        async with client([await rejecting.start()]) as engine:  # the data's fault, not the server's
            with pytest.raises(ContextTooLong, match="rejected the request \\(400\\): The input"):
                await engine.generate([1], SamplingParams(max_new_tokens=3))
        await rejecting.stop()
        other = FakeSGLangServer(scripted((400, {"error": {"message": "Unknown sampling parameter"}})))
        async with client([await other.start()]) as engine:
            with pytest.raises(ValueError, match="Unknown sampling parameter") as info:
                await engine.generate([1], SamplingParams(max_new_tokens=3))
            assert not isinstance(info.value, ContextTooLong)
        await other.stop()
        async with client([f"http://127.0.0.1:{free_port()}"]) as engine:
            with pytest.raises(SGLangError, match="connect failed"):
                await engine.generate([1], SamplingParams(max_new_tokens=3))
            with pytest.raises(SGLangError, match="no healthy SGLang server"):
                await engine.generate([1], SamplingParams(max_new_tokens=3))

    run(main())


def test_least_in_flight_routing():
    async def main():
        release = asyncio.Event()

        async def slow(req, body):
            await release.wait()
            return canned_response(req)

        servers = [FakeSGLangServer(slow) for _ in range(3)]
        urls = [await s.start() for s in servers]
        async with client(urls) as engine:
            tasks = [asyncio.create_task(engine.generate([1], SamplingParams(max_new_tokens=3))) for _ in range(9)]
            while sum(len(s.requests) for s in servers) < 9:
                await asyncio.sleep(0.01)
            in_flight = [s.in_flight for s in engine.pool.servers]
            release.set()
            await asyncio.gather(*tasks)
        for s in servers:
            await s.stop()
        return in_flight, [len(s.requests) for s in servers]

    in_flight, counts = run(main())
    assert in_flight == [3, 3, 3] and counts == [3, 3, 3]


def test_health_checks_take_servers_out_and_bring_them_back():
    async def main():
        a, b = (FakeSGLangServer(scripted(canned_response), health_generation=False) for _ in range(2))
        urls = [await a.start(), await b.start()]
        async with client(urls, health_check_interval_s=0.05) as engine:
            a.healthy = False
            await until(lambda: not engine.pool.servers[0].healthy, "a's health probe taking it out")
            down = [s.healthy for s in engine.pool.servers]
            outs = [await engine.generate([1], SamplingParams(max_new_tokens=3)) for _ in range(4)]
            a.healthy = True
            await until(lambda: engine.pool.servers[0].healthy, "a's health probe bringing it back")
            up = [s.healthy for s in engine.pool.servers]
            await engine.wait_healthy(timeout_s=5)
        async with client(urls) as engine:
            b.healthy = False
            with pytest.raises(SGLangError, match=f"not healthy after 0s: {b.url}"):
                await engine.wait_healthy(timeout_s=0.2, poll_s=0.05)
            await engine.wait_healthy(timeout_s=0.2, require_all=False)
        await a.stop()
        await b.stop()
        return down, outs, up, b

    down, outs, up, b = run(main())
    assert down == [False, True] and up == [True, True]
    assert all(o.meta["server"] == b.url for o in outs)


def test_control_calls_follow_io_struct_schema():
    async def main():
        servers = [FakeSGLangServer(scripted(canned_response), tp_size=2, enable_memory_saver=True)
                   for _ in range(2)]
        urls = [await s.start() for s in servers]
        async with client(urls, tp_size=2) as engine:
            await engine.pause(mode="in_place")
            await engine.resume()
            await engine.flush_cache()
            await engine.pause(mode="retract")
            await engine.release_memory_occupation(["kv_cache"])
            released = [set(s.memory_released) for s in servers]
            await engine.resume_memory_occupation()
            await engine.resume()
            world = await engine.init_weights_update_group(master_address="10.0.0.1", master_port=29500,
                                                           group_name="g", backend="nccl")
            await engine.begin_weight_update()
            await engine.update_weights_from_distributed(names=["model.norm.weight"], dtypes=["bfloat16"],
                                                         shapes=[[64]], group_name="g", weight_version="3")
            await engine.update_weights_from_tensor([["YWJj", "ZGVm"]] * 2, weight_version="3")
            await engine.end_weight_update()
            await engine.destroy_weights_update_group("g")
            with pytest.raises(ValueError, match="pause mode"):
                await engine.pause(mode="freeze")
        for s in servers:
            await s.stop()
        return servers, world, released

    servers, world, released = run(main())
    assert world == 5 and released == [{"kv_cache"}, {"kv_cache"}]
    for server in servers:
        assert server.contract_errors == []
    offsets = sorted(b["rank_offset"] for s in servers for p, b in s.requests if p == "/init_weights_update_group")
    assert offsets == [1, 3]
    paths = [p for p, _ in servers[0].requests]
    assert paths == ["/pause_generation", "/continue_generation", "/flush_cache", "/pause_generation",
                     "/server_info", "/release_memory_occupation", "/resume_memory_occupation",
                     "/continue_generation", "/init_weights_update_group", "/begin_weight_update",
                     "/update_weights_from_distributed", "/update_weights_from_tensor", "/end_weight_update",
                     "/destroy_weights_update_group"]


def test_a_failing_control_call_names_the_server():
    async def main():
        good = FakeSGLangServer(scripted(canned_response))
        urls = [await good.start(), f"http://127.0.0.1:{free_port()}"]
        async with client(urls) as engine:
            with pytest.raises(SGLangError, match=urls[1] + "/flush_cache"):
                await engine.flush_cache()
            with pytest.raises(SGLangError, match="unknown field"):  # the fake rejects it as SGLang would
                await engine.call_all("/pause_generation", {"mode": "abort", "bogus": 1})
        await good.stop()

    run(main())


def test_pause_abort_returns_partial_generations_and_resume_continues(make_engine, tiny_llama):
    async def main():
        backend = make_engine(tiny_llama, eos_token_ids=(0,))
        server = FakeSGLangServer(local_engine_handler(backend), engine=backend)
        async with client([await server.start()]) as engine:
            long = asyncio.create_task(engine.generate([1, 2, 3], SamplingParams(max_new_tokens=1000, seed=1)))
            await until_sampling(backend, 4)  # the abort lands after 4 tokens (a 0.3 s sleep raced a loaded machine)
            await engine.pause(mode="abort")
            aborted = await long
            late = asyncio.create_task(engine.generate([1, 2, 3], SamplingParams(max_new_tokens=4, seed=1)))
            await asyncio.sleep(0.1)
            held = not late.done()
            await engine.resume()
            after = await late
        await server.stop()
        await backend.close()
        return aborted, held, after, server

    aborted, held, after, server = run(main())
    assert aborted.finish_reason is FinishReason.ABORT and 0 < len(aborted.token_ids) < 1000
    assert len(aborted.logprobs) == len(aborted.token_ids)
    assert held and after.finish_reason is FinishReason.LENGTH and after.token_ids == aborted.token_ids[:4]
    assert not server.contract_errors


def test_cancelled_generate_aborts_on_the_server():
    async def main():
        async def until_aborted(req, body):  # like SGLang: runs until /abort_request names its rid
            while ("/abort_request", {"rid": req.rid}) not in server.requests:
                await asyncio.sleep(0.01)
            return canned_response(req, ids=(), finish=api_types().FinishAbort(message="Aborted"))

        server = FakeSGLangServer(until_aborted)
        async with client([await server.start()]) as engine:
            task = asyncio.create_task(engine.generate([1], SamplingParams(max_new_tokens=3)))
            await until(lambda: any(p == "/generate" for p, _ in server.requests), "the request reaching the server")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await until(lambda: any(p == "/abort_request" for p, _ in server.requests), "the abort reaching the server")
        await server.stop()
        return server

    server = run(main())
    generate_rid = next(b["rid"] for p, b in server.requests if p == "/generate")
    assert ("/abort_request", {"rid": generate_rid}) in server.requests
    assert not server.contract_errors


def test_bad_calls_are_clear_errors():
    async def main():
        async with client(["http://127.0.0.1:1"]) as engine:
            with pytest.raises(ValueError, match="empty"):
                await engine.generate([], SamplingParams(max_new_tokens=1))
            with pytest.raises(ValueError, match="not text"):
                await engine.generate("hi", SamplingParams(max_new_tokens=1))
            with pytest.raises(TypeError, match="SamplingParams"):
                await engine.generate([1], {"max_new_tokens": 1})
        assert not hasattr(engine, "update_weights")  # weights come through megatron_tir.rollout.sync.sglang

    run(main())


@pytest.mark.parametrize("overrides,message", [
    (dict(server_urls=()), "server_urls is empty"),
    (dict(server_urls=("localhost:30000",)), "http://"),
    (dict(server_urls=("http://a:1", "http://a:1/")), "duplicates"),
    (dict(eos_token_ids=()), "eos_token_ids"),
    (dict(tp_size=0), "tp_size"),
    (dict(max_attempts=0), "max_attempts"),
    (dict(request_timeout_s=0), "request_timeout_s"),
])
def test_config_validation(overrides, message):
    kwargs = dict(server_urls=("http://127.0.0.1:30000",), eos_token_ids=(2,)) | overrides
    with pytest.raises(ValueError, match=message):
        SGLangEngineConfig(**kwargs)

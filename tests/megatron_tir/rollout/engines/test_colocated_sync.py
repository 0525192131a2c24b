"""Colocated mode: the weight sync frees the engine's memory around each training phase, in
SGLang 0.5.23's order, and refuses a layout its CUDA IPC handles cannot reach.

The fake server (fake_sglang.py, rule 4) kills its scheduler on a weight load into
released weights and on a forward pass with memory released, as the real one does with
the memory saver on. ``serialize_for_tp_ranks`` needs CUDA (its handles are CUDA IPC
handles): on CPU the payload is a stand-in string, which the fake does not open.
"""

from __future__ import annotations

import pytest
import torch
from engine_testing import run
from fake_sglang import FakeSGLangServer
from sglang_testing import canned_response, client, scripted

from megatron_tir.rollout.engines.base import MEMORY_TAGS, FinishReason, PauseMode, SamplingParams
from megatron_tir.rollout.engines.sglang import SGLangError
from megatron_tir.rollout.sync import sglang as ws
from megatron_tir.rollout.sync.local import LocalWeightSync

PARAMS = SamplingParams(max_new_tokens=3)
BUCKETS = [(0, [("model.norm.weight", torch.ones(4))])]

# One step, as SGLang requires it (weight_updater.py: release on an idle scheduler;
# weights back before the load; kv_cache + cuda_graph back before generation continues).
COLOCATED_STEP = [
    ("/pause_generation", None),
    ("/flush_cache", None),  # retried until the scheduler is idle (release asserts it)
    ("/release_memory_occupation", list(MEMORY_TAGS)),
    ("/resume_memory_occupation", ["weights"]),
    ("/begin_weight_update", None),
    ("/update_weights_from_tensor", None),
    ("/end_weight_update", None),
    ("/flush_cache", None),
    ("/resume_memory_occupation", ["kv_cache", "cuda_graph"]),
    ("/continue_generation", None),
]


@pytest.fixture
def cpu_payloads(monkeypatch):
    monkeypatch.setattr(ws, "serialize_for_tp_ranks", lambda bucket, tp, flattened=False: ["c3RhbmQtaW4="] * tp)


def control_calls(server: FakeSGLangServer) -> list[tuple[str, list | None]]:
    skip = ("/generate", "/server_info", "/model_info")
    calls = []
    for path, body in server.requests:
        call = (path, body.get("tags") if path.endswith("_occupation") else None)
        if path not in skip and not (calls and calls[-1] == call == ("/flush_cache", None)):  # retries: one
            calls.append(call)
    return calls


def test_colocated_step_frees_memory_while_training_in_sglangs_order(cpu_payloads):
    async def main():
        server = FakeSGLangServer(scripted(canned_response), enable_memory_saver=True)
        async with client([await server.start()]) as engine:
            sync = ws.TensorWeightSync(engine)
            await sync.start()
            before = await engine.generate([1, 2], PARAMS)
            calls = []
            for _ in range(2):
                mark = len(control_calls(server))
                await sync.offload()
                freed_while_training = set(server.memory_freed)
                version = await sync.update(BUCKETS)
                after = await engine.generate([1, 2], PARAMS)
                calls.append((control_calls(server)[mark:], freed_while_training, version, after))
        await server.stop()
        return server, before, calls

    server, before, calls = run(main())
    assert server.crashed is None and server.contract_errors == []
    assert before.versions == [0, 0, 0]
    for step, (seq, freed, version, after) in enumerate(calls, start=1):
        assert seq == COLOCATED_STEP
        assert freed == set(MEMORY_TAGS)
        assert version == step and after.finish_reason is FinishReason.LENGTH and after.versions == [step] * 3
    assert server.memory_freed == set() and server.weight_version == "2"


def test_the_fake_refuses_a_load_into_released_weights(cpu_payloads):
    async def main():
        server = FakeSGLangServer(scripted(canned_response), enable_memory_saver=True)
        async with client([await server.start()]) as engine:
            await engine.pause(mode=PauseMode.RETRACT)  # the scheduler pauses: idle at once
            await engine.release_memory_occupation()
            await engine.begin_weight_update()
            with pytest.raises(SGLangError):
                await engine.update_weights_from_tensor([["c3RhbmQtaW4="]])
        await server.stop()
        return server

    assert "weight load into released weights" in run(main()).crashed


def test_the_fake_refuses_generation_with_memory_still_released():
    async def main():
        server = FakeSGLangServer(scripted(canned_response), enable_memory_saver=True)
        async with client([await server.start()]) as engine:
            await engine.pause(mode=PauseMode.RETRACT)  # the scheduler pauses: idle at once
            await engine.release_memory_occupation()
            await engine.resume_memory_occupation(["weights"])
            await engine.resume()  # kv_cache and cuda_graph still released
            out = await engine.generate([1, 2], PARAMS)
        await server.stop()
        return server, out

    server, out = run(main())
    assert out.finish_reason is FinishReason.ABORT and "illegal memory access" in server.crashed


def test_a_layout_needing_cross_node_ipc_is_refused_at_start():
    async def main():
        # 192.0.2.1 is TEST-NET-1 (RFC 5737): never this node; nothing is contacted
        async with client(["http://192.0.2.1:30000"], connect_timeout_s=1.0) as engine:
            sync = ws.TensorWeightSync(engine)
            with pytest.raises(ValueError) as caught:
                await sync.start()
        return str(caught.value)

    message = run(main())
    assert "\n" not in message and "http://192.0.2.1:30000" in message and "this trainer rank's node" in message
    ws.check_node_local(["http://127.0.0.1:30000", "http://localhost:1"])  # loopback is this node
    ws.check_node_local(["http://10.1.2.3:30000"], frozenset({"10.1.2.3"}))  # one of this node's addresses


def test_the_local_engine_follows_the_same_contract(tiny_qwen2, make_engine):
    async def main():
        engine = make_engine(tiny_qwen2, eos_token_ids=(0,), seed=0)
        calls = []
        for name in ("pause", "release_memory_occupation", "resume_memory_occupation", "update_weights", "resume"):
            real = getattr(engine, name)

            async def recorded(*args, _real=real, _name=name, **kwargs):
                calls.append((_name, list(args[0]) if args and _name.endswith("occupation") else None))
                return await _real(*args, **kwargs)

            setattr(engine, name, recorded)
        sync = LocalWeightSync(engine)
        await sync.start()
        await engine.generate([1, 2], PARAMS)
        await sync.offload()
        released = engine.released_memory
        with pytest.raises(RuntimeError, match="weights are released"):
            await engine.update_weights([])
        with pytest.raises(RuntimeError, match="still released"):
            await engine.resume()
        calls.clear()
        norm = dict(engine.model.named_parameters())["model.norm.weight"]
        version = await sync.update([(0, [("model.norm.weight", torch.full_like(norm, 0.5))])])
        out = await engine.generate([1, 2], PARAMS)
        await engine.close()
        return released, calls, version, out, norm

    released, calls, version, out, norm = run(main())
    assert released == MEMORY_TAGS
    assert [c[0] for c in calls] == ["resume_memory_occupation", "update_weights", "resume_memory_occupation", "resume"]
    assert calls[0][1] == ["weights"]
    assert version == 1 and out.versions == [1] * len(out.token_ids) and torch.all(norm == 0.5)


@pytest.mark.parametrize("load_format", ["flattened_bucket", None])
def test_the_tensor_sync_sends_buckets_in_the_format_it_serialised(monkeypatch, load_format):
    """``flattened_bucket`` (the default): each bucket serialised as SGLang's flattened bucket
    (one IPC handle) and announced with that ``load_format`` (io_struct's field, checked by the
    fake's schema); None: the per-tensor dump and no ``load_format``."""
    asked = []

    def stand_in(bucket, tp, flattened=False):
        asked.append(flattened)
        return ["c3RhbmQtaW4="] * tp

    monkeypatch.setattr(ws, "serialize_for_tp_ranks", stand_in)

    async def main():
        server = FakeSGLangServer(scripted(canned_response))
        async with client([await server.start()]) as engine:
            sync = ws.TensorWeightSync(engine, load_format=load_format)
            await sync.start()
            await sync.update(BUCKETS + BUCKETS)
        await server.stop()
        return server

    server = run(main())
    bodies = [body for path, body in server.requests if path == "/update_weights_from_tensor"]
    assert [b.get("load_format") for b in bodies] == [load_format] * 2 and not server.contract_errors
    assert asked == [load_format == "flattened_bucket"] * 2

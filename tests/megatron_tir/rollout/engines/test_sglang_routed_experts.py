"""SGLang 0.5.23's routed experts (``return_routed_experts``) from request to trajectory: the request
fields, the answer's base64 int32 rows, the fake server held to the real one (fake_sglang_routing.py),
and a trajectory's trace over several requests, equal to transformers' own top-k of the whole sequence."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from engine_testing import run
from fake_sglang import FakeSGLangServer
from fake_sglang_backend import local_engine_handler
from sglang_schema import api_types
from sglang_testing import client

from megatron_tir.rollout.engines.base import FinishReason, SamplingParams
from megatron_tir.rollout.engines.sglang import SGLangError, build_generate_request, parse_generate_response
from megatron_tir.rollout.routing_trace import RoutingTrace


def _answer(output_ids, *, routed=None, finish=None):
    meta = {"output_token_logprobs": [[-0.5, t, None] for t in output_ids], "weight_version": "default",
            "finish_reason": finish or {"type": "length", "length": len(output_ids)}}
    if routed is not None:
        meta["routed_experts"] = routed
    return {"output_ids": list(output_ids), "meta_info": meta}


def _b64(a: np.ndarray) -> str:  # detokenizer_manager._b64_encode_per_request
    return base64.b64encode(a.astype(np.int32).tobytes()).decode("utf-8")


def test_the_request_asks_and_the_answer_is_decoded():
    asked = build_generate_request([1, 2, 3], SamplingParams(max_new_tokens=4, routed_experts_from=2), rid="r")
    assert asked["return_routed_experts"] is True and asked["routed_experts_start_len"] == 2
    assert api_types().GenerateRequest.from_json_value(asked).routed_experts_start_len == 2  # the server's contract
    plain = build_generate_request([1, 2, 3], SamplingParams(max_new_tokens=4), rid="r")
    assert "return_routed_experts" not in plain and "routed_experts_start_len" not in plain

    ids = np.arange(4 * 3 * 2).reshape(4, 3, 2)  # positions 2 .. 5 of 3 prompt + 4 output tokens, 3 layers, k 2
    gen = parse_generate_response(_answer([7, 8, 9, 10], routed=_b64(ids)), prompt_tokens=3, eos_token_ids=(),
                                  routed_experts_from=2)
    assert gen.routed_experts.dtype == torch.int32 and torch.equal(gen.routed_experts, torch.from_numpy(ids).view(4, 6))
    assert parse_generate_response(_answer([7]), prompt_tokens=3, eos_token_ids=()).routed_experts is None


@pytest.mark.parametrize("routed,message", [
    (None, "launch the servers with --enable-return-routed-experts"),
    (_b64(np.zeros(7)), "7 ids, not a whole number per each of 4 positions"),
    ("not base64!", "not base64 of int32s"),
])
def test_a_broken_answer_is_refused(routed, message):
    with pytest.raises(SGLangError, match=message):
        parse_generate_response(_answer([7, 8, 9, 10], routed=routed), prompt_tokens=3, eos_token_ids=(),
                                routed_experts_from=2)


def test_an_aborted_request_may_come_without_them():
    gen = parse_generate_response(_answer([], finish={"type": "abort", "message": "Abort before prefill"}),
                                  prompt_tokens=3, eos_token_ids=(), routed_experts_from=0)
    assert gen.finish_reason is FinishReason.ABORT and gen.routed_experts is None


def _hf_topk(model_dir, seq: list[int]) -> torch.Tensor:
    """transformers' top-k experts of every position of ``seq``, ``[len, layers, k]`` (sorted)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([seq]), output_router_logits=True).router_logits
    k = model.config.num_experts_per_tok
    return torch.stack([lg.topk(k, dim=-1).indices for lg in logits], dim=1).sort(dim=-1).values


def test_a_trajectorys_requests_trace_every_position(make_engine, tiny_qwen3_moe):
    """Three requests as the driver makes them (a turn, a continuation, feedback then a turn): each asks
    from the first position the trace lacks; the trace is the router's top-k of the final sequence."""
    async def main():
        backend = make_engine(tiny_qwen3_moe)
        server = FakeSGLangServer(local_engine_handler(backend), engine=backend)
        server.enable_return_routed_experts = True
        url = await server.start()
        trace, seq = RoutingTrace(), list(range(3, 12))
        async with client([url]) as engine:
            for step, extra in enumerate(([], [], [41, 42, 43])):  # the last request follows tool feedback
                seq += extra
                params = SamplingParams(max_new_tokens=5, seed=step, routed_experts_from=trace.covered)
                gen = await engine.generate(seq, params)
                trace.add(gen.routed_experts, start=params.routed_experts_from)
                seq += gen.token_ids
            with pytest.raises(ValueError, match="is higher than the number of input tokens"):  # the scheduler's 400
                await engine.generate([1, 2], SamplingParams(max_new_tokens=2, routed_experts_from=3))
        server.enable_return_routed_experts = False  # a server launched without the flag answers without them
        async with client([url]) as engine:
            with pytest.raises(SGLangError, match="--enable-return-routed-experts"):
                await engine.generate([1, 2], SamplingParams(max_new_tokens=2, routed_experts_from=0))
        await server.stop()
        await backend.close()
        return trace, seq, server

    trace, seq, server = run(main())
    assert trace.covered == len(seq) - 1  # every forwarded position; the last token was never forwarded
    starts = [b.get("routed_experts_start_len") for p, b in server.requests if p == "/generate"][:3]
    assert starts[0] == 0 and starts[1] > 0 and starts[2] > starts[1]  # nothing asked twice
    assert torch.equal(trace.rows().view(len(seq) - 1, 2, 2).sort(dim=-1).values.long(),
                       _hf_topk(tiny_qwen3_moe, seq[:-1]))
    (refused,) = server.contract_errors  # the one deliberate refusal, nothing else broke SGLang's contract
    assert "routed_experts_start_len=3 is higher than the number of input tokens" in refused


def test_a_trace_drops_the_routing_of_discarded_tokens():
    trace = RoutingTrace()
    trace.add(torch.arange(12, dtype=torch.int32).view(6, 2), start=0)
    trace.truncate(4)  # the driver cut the turn's overshoot: the sequence has 4 tokens left
    assert trace.covered == 4 and torch.equal(trace.rows(), torch.arange(8, dtype=torch.int16).view(4, 2))
    trace.add(None, start=4)  # an aborted request: nothing
    with pytest.raises(ValueError, match="does not continue the trace at 4"):
        trace.add(torch.zeros(2, 2, dtype=torch.int32), start=5)

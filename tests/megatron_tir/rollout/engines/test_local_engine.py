"""LocalEngine against independent references: a plain HF forward pass, serial runs, full-text decoding."""

from __future__ import annotations

import asyncio

import pytest
import torch
from megatron_tir.rollout.engines.base import (
    FinishReason,
    GenerationEngine,
    PauseMode,
    SamplingParams,
)
from megatron_tir.rollout.engines.local import LocalEngine, LocalEngineConfig
from transformers import AutoModelForCausalLM

from engine_testing import protocol_mismatches, reference_logprobs, run, until_sampling

PROMPTS = ["def add(a, b):", "The capital of France is", "Question: what is 12 * 7?\nAnswer:", "x"]


def encode(engine, text):
    return engine.tokenizer(text).input_ids


def first_stop_index(tokenizer, token_ids, stop):
    """Reference: the first i such that `stop` is in the decoded text of token_ids[:i+1]."""
    for i in range(len(token_ids)):
        if stop in tokenizer.decode(token_ids[: i + 1], skip_special_tokens=False):
            return i
    return None


def test_engine_matches_the_protocol_signatures(make_engine, tiny_llama):
    assert protocol_mismatches(LocalEngine, GenerationEngine) == []
    engine = make_engine(tiny_llama)
    assert isinstance(engine.eos_token_ids, tuple) and engine.eos_token_ids


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, -1), (0.7, 0.9, 50), (0.0, 1.0, -1)])
def test_logprobs_equal_a_full_forward_pass(make_engine, tiny_llama, tiny_qwen2, family, temperature, top_p, top_k):
    model_dir = tiny_llama if family == "llama" else tiny_qwen2
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    async def main():
        engine = make_engine(model_dir, eos_token_ids=(0,))
        prompts = [encode(engine, p) for p in PROMPTS]
        params = [SamplingParams(max_new_tokens=12, temperature=temperature, top_p=top_p, top_k=top_k, seed=i)
                  for i in range(len(prompts))]
        outs = await asyncio.gather(*(engine.generate(p, sp) for p, sp in zip(prompts, params)))
        await engine.close()
        return prompts, outs

    prompts, outs = run(main())
    for prompt, out in zip(prompts, outs):
        assert out.prompt_tokens == len(prompt)
        assert len(out.token_ids) == len(out.logprobs) >= 1
        ref = reference_logprobs(reference, prompt, out.token_ids, temperature)
        torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=0)
        if temperature == 0.0:  # greedy: every token is the arg-max of the reference forward
            ids = torch.tensor([prompt + out.token_ids])
            with torch.no_grad():
                argmax = reference(input_ids=ids).logits[0, len(prompt) - 1 : -1].argmax(-1)
            assert out.token_ids == argmax.tolist()


@pytest.mark.slow
def test_smollm2_logprobs_eos_and_defaults(make_engine, smollm2_dir):
    reference = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()

    async def main():
        engine = make_engine("smollm2")
        # SmolLM2's generation config names <|im_end|> (2); <|endoftext|> (0) ends base-style text.
        assert engine.eos_token_ids == (2, 0)
        chat = encode(engine, "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
        code = encode(engine, "def fib(n):")
        greedy, sampled = await asyncio.gather(
            engine.generate(chat, SamplingParams(max_new_tokens=24, temperature=0.0)),
            engine.generate(code, SamplingParams(max_new_tokens=6, temperature=1.0, seed=3)),
        )
        await engine.close()
        return chat, code, greedy, sampled

    chat, code, greedy, sampled = run(main())
    assert greedy.finish_reason is FinishReason.EOS and greedy.token_ids[-1] == 2  # the EOS token is kept
    assert sampled.finish_reason is FinishReason.LENGTH and len(sampled.token_ids) == 6
    for prompt, out, t in ((chat, greedy, 0.0), (code, sampled, 1.0)):
        ref = reference_logprobs(reference, prompt, out.token_ids, t)
        torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=0)


def test_concurrent_batching_matches_serial_runs(make_engine, tiny_qwen2):
    """Five requests through a batch of three, some arriving mid-flight, equal one-at-a-time runs."""
    specs = [(PROMPTS[i % 4] * (1 + i), SamplingParams(max_new_tokens=6 + 5 * i, temperature=0.9, seed=100 + i))
             for i in range(5)]

    async def main():
        engine = make_engine(tiny_qwen2, max_batch_size=3, eos_token_ids=(0,))
        serial = [await engine.generate(encode(engine, text), sp) for text, sp in specs]

        async def late(text, sp, delay):
            await asyncio.sleep(delay)
            return await engine.generate(encode(engine, text), sp)

        batched = await asyncio.gather(*(late(text, sp, 0.02 * i) for i, (text, sp) in enumerate(specs)))
        await engine.close()
        return serial, batched

    serial, batched = run(main())
    for one, many in zip(serial, batched):
        assert many.token_ids == one.token_ids
        assert many.finish_reason is one.finish_reason is FinishReason.LENGTH
        torch.testing.assert_close(torch.tensor(many.logprobs), torch.tensor(one.logprobs), atol=1e-4, rtol=0)


def test_seed_reproducibility(make_engine, tiny_llama):
    async def main():
        engine = make_engine(tiny_llama, eos_token_ids=(0,))
        prompt = encode(engine, PROMPTS[0])
        a, b, c = [await engine.generate(prompt, SamplingParams(max_new_tokens=16, seed=s)) for s in (7, 7, 8)]
        await engine.close()
        # An engine-level seed makes unseeded requests reproducible across engines.
        runs = []
        for _ in range(2):
            engine = make_engine(tiny_llama, eos_token_ids=(0,), seed=11)
            runs.append(await engine.generate(prompt, SamplingParams(max_new_tokens=16)))
            await engine.close()
        return a, b, c, runs

    a, b, c, runs = run(main())
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert a.token_ids != c.token_ids
    assert runs[0].token_ids == runs[1].token_ids


def test_stop_string_split_across_tokens(make_engine, tiny_llama):
    async def main():
        engine = make_engine(tiny_llama, eos_token_ids=(0,))
        tok = engine.tokenizer
        prompt = encode(engine, PROMPTS[1])
        params = dict(max_new_tokens=40, temperature=1.0, seed=5)
        free = await engine.generate(prompt, SamplingParams(**params))
        # A stop string made of the end of token 5 and the start of token 6 (it spans the boundary).
        t5, t6 = tok.decode(free.token_ids[5:6]), tok.decode(free.token_ids[6:7])
        stop = t5[-2:] + t6[:2]
        assert len(t5) >= 2 and len(t6) >= 2, (t5, t6)
        stopped = await engine.generate(prompt, SamplingParams(stop=("never-there", stop), **params))
        await engine.close()
        return tok, free, stop, stopped

    tok, free, stop, stopped = run(main())
    expected = first_stop_index(tok, free.token_ids, stop)
    assert expected is not None and expected <= 6
    assert stopped.finish_reason is FinishReason.STOP and stopped.matched_stop == stop
    assert stopped.token_ids == free.token_ids[: expected + 1]  # the completing token is kept
    # the repeat reuses the first request's cached prompt K/V (prefix cache): equal up to float rounding
    torch.testing.assert_close(torch.tensor(stopped.logprobs), torch.tensor(free.logprobs[: expected + 1]),
                               atol=1e-5, rtol=0)
    assert stop in tok.decode(stopped.token_ids)


def test_stop_strings_never_match_inside_the_prompt(make_engine, tiny_llama):
    async def main():
        engine = make_engine(tiny_llama, eos_token_ids=(0,))
        tok = engine.tokenizer
        prompt_text = "Run this:\n```python\nprint(1)\n```"
        prompt = encode(engine, prompt_text)
        params = dict(max_new_tokens=20, temperature=1.0, seed=9)
        free = await engine.generate(prompt, SamplingParams(**params))
        gen_text = tok.decode(free.token_ids)
        inside = "```"  # occurs in the prompt only (checked below)
        straddling = prompt_text[-3:] + gen_text[:2]  # matches only across the prompt boundary
        out = await engine.generate(prompt, SamplingParams(stop=(inside, straddling), **params))
        await engine.close()
        return tok, free, gen_text, inside, straddling, out

    tok, free, gen_text, inside, straddling, out = run(main())
    assert inside not in gen_text and straddling not in gen_text
    assert out.finish_reason is FinishReason.LENGTH and out.matched_stop is None
    assert out.token_ids == free.token_ids


def test_eos_length_and_context_limit(make_engine, tiny_llama):
    async def main():
        engine = make_engine(tiny_llama, eos_token_ids=(0,))
        prompt = encode(engine, PROMPTS[2])
        params = dict(max_new_tokens=30, temperature=1.0, seed=21)
        free = await engine.generate(prompt, SamplingParams(**params))
        await engine.close()
        # Declare the token sampled at step 4 an EOS id: generation ends at its first occurrence.
        eos = free.token_ids[4]
        engine = make_engine(tiny_llama, eos_token_ids=(eos,))
        assert engine.eos_token_ids == (eos,)
        ended = await engine.generate(prompt, SamplingParams(**params))
        await engine.close()
        engine = make_engine(tiny_llama, eos_token_ids=(0,), max_seq_len=len(prompt) + 5)
        capped = await engine.generate(prompt, SamplingParams(**params))
        await engine.close()
        return free, eos, ended, capped

    free, eos, ended, capped = run(main())
    assert free.finish_reason is FinishReason.LENGTH and len(free.token_ids) == 30
    first = free.token_ids.index(eos)
    assert ended.finish_reason is FinishReason.EOS and ended.matched_stop is None
    assert ended.token_ids == free.token_ids[: first + 1]  # the EOS token is kept, with its log-prob
    assert capped.finish_reason is FinishReason.LENGTH and capped.meta.get("context_limit") is True
    assert capped.token_ids == free.token_ids[:5]


def test_update_weights_changes_outputs_like_a_reloaded_model(make_engine, tiny_qwen2, tmp_path):
    """After update_weights the engine's log-probs equal a fresh HF model holding the same weights,
    for one row (the slot decoder's transposed copies) and for three rows decoded together (its
    oneDNN-packed copies): both are refreshed from the updated weights. The update arrives in two
    buckets, as a weight sync sends it, and each refreshes only its own weights' copies."""
    new_model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for p in new_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    named = [(n, t.to(torch.bfloat16).float()) for n, t in new_model.state_dict().items()]
    with torch.no_grad():  # the reference holds exactly what the engine receives
        new_model.load_state_dict(dict(named))

    async def main():
        engine = make_engine(tiny_qwen2, eos_token_ids=(0,))
        prompt = encode(engine, PROMPTS[0])
        params = SamplingParams(max_new_tokens=10, temperature=0.0)
        before = await engine.generate(prompt, params)
        half = len(named) // 2
        await engine.update_weights(iter(named[:half]))
        await engine.update_weights(iter(named[half:]))
        after = await engine.generate(prompt, params)
        together = [encode(engine, p) for p in PROMPTS[:3]]
        outs = await asyncio.gather(*(engine.generate(p, params) for p in together))
        version = engine.weight_version
        await engine.close()
        return prompt, before, after, version, list(zip(together, outs))

    prompt, before, after, version, together = run(main())
    assert version == 2 and after.meta["weight_version"] == 2  # one version per update_weights call
    assert after.logprobs != before.logprobs
    for p, out in [(prompt, after), *together]:
        ref = reference_logprobs(new_model, p, out.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=0)


def test_update_weights_tied_head_alias(make_engine, tiny_llama):
    async def main():
        engine = make_engine(tiny_llama, eos_token_ids=(0,))
        emb = engine.model.get_input_embeddings().weight
        new = torch.randn_like(emb)
        await engine.update_weights([("lm_head.weight", new)])  # tied: the same storage as the embedding
        same = torch.equal(emb, new) and torch.equal(engine.model.get_output_embeddings().weight, new)
        await engine.close()
        return same

    assert run(main())


def test_update_weights_rejects_bad_input_and_changes_nothing(make_engine, tiny_llama):
    async def main():
        engine = make_engine(tiny_llama, eos_token_ids=(0,))
        before = {n: t.clone() for n, t in engine.model.state_dict().items()}
        good = ("model.norm.weight", torch.zeros(64))
        cases = {
            "unknown parameter name": [good, ("model.layers.9.mlp.up_proj.weight", torch.zeros(128, 64))],
            "has shape": [good, ("model.embed_tokens.weight", torch.zeros(10, 64))],
            "not a torch.Tensor": [good, ("model.norm.weight", [0.0] * 64)],
            "floating dtype": [("model.norm.weight", torch.zeros(64, dtype=torch.long))],
        }
        for message, updates in cases.items():
            with pytest.raises(ValueError, match=message):
                await engine.update_weights(updates)
        unchanged = all(torch.equal(t, before[n]) for n, t in engine.model.state_dict().items())
        version = engine.weight_version
        await engine.close()
        return unchanged, version

    unchanged, version = run(main())
    assert unchanged and version == 0


def test_pause_holds_in_flight_and_resume_continues_identically(make_engine, tiny_llama):
    async def main():
        engine = make_engine(tiny_llama, eos_token_ids=(0,))
        prompt = encode(engine, PROMPTS[3])
        params = SamplingParams(max_new_tokens=60, seed=4)
        reference = await engine.generate(prompt, params)

        task = asyncio.create_task(engine.generate(prompt, params))
        await until_sampling(engine)
        await engine.pause(mode=PauseMode.IN_PLACE)
        late = asyncio.create_task(engine.generate(prompt, params))  # queued while paused
        await asyncio.sleep(0.3)
        held = not task.done() and not late.done()
        await engine.resume()
        resumed, late_out = await asyncio.gather(task, late)
        await engine.close()
        return reference, held, resumed, late_out

    reference, held, resumed, late_out = run(main())
    assert held
    for out in (resumed, late_out):
        assert out.token_ids == reference.token_ids and out.finish_reason is FinishReason.LENGTH


def test_pause_with_abort_returns_partial_generations(make_engine, tiny_llama):
    async def main():
        engine = make_engine(tiny_llama, eos_token_ids=(0,))
        prompt = encode(engine, PROMPTS[0])
        params = SamplingParams(max_new_tokens=200, seed=8)
        reference = await engine.generate(prompt, SamplingParams(max_new_tokens=200, seed=8))
        task = asyncio.create_task(engine.generate(prompt, params))
        await until_sampling(engine)
        await engine.pause(mode=PauseMode.ABORT)
        aborted = await task
        await engine.resume()
        again = await engine.generate(prompt, SamplingParams(max_new_tokens=3, seed=8))
        await engine.close()
        return reference, aborted, again

    reference, aborted, again = run(main())
    assert aborted.finish_reason is FinishReason.ABORT
    assert 0 < len(aborted.token_ids) < 200
    assert aborted.token_ids == reference.token_ids[: len(aborted.token_ids)]
    # the repeat reuses the reference's cached prompt K/V (prefix cache): equal up to float rounding
    torch.testing.assert_close(torch.tensor(aborted.logprobs), torch.tensor(reference.logprobs[: len(aborted.logprobs)]),
                               atol=1e-5, rtol=0)
    assert again.token_ids == reference.token_ids[:3]


def test_pause_retract_recomputes_the_cache_and_continues_identically(make_engine, tiny_llama):
    """Retract drops the KV cache; on resume prompt + generated ids are prefilled again."""
    async def main():
        engine = make_engine(tiny_llama, eos_token_ids=(0,))
        prompt = encode(engine, PROMPTS[2])
        params = SamplingParams(max_new_tokens=600, seed=5)
        reference = await engine.generate(prompt, params)
        task = asyncio.create_task(engine.generate(prompt, params))
        await until_sampling(engine)
        await engine.pause(mode=PauseMode.RETRACT)
        held_without_cache = not task.done() and engine._batch.cache is None and len(engine._queue) == 1
        partial = len(engine._queue[0].token_ids)
        await engine.resume()
        out = await task
        await engine.close()
        return reference, held_without_cache, partial, out

    reference, held_without_cache, partial, out = run(main())
    assert held_without_cache and 0 < partial < 600
    assert out.token_ids == reference.token_ids and out.finish_reason is FinishReason.LENGTH
    assert out.logprobs == pytest.approx(reference.logprobs, abs=1e-4)  # re-prefilled: batched vs stepwise
    assert out.meta["weight_versions"] == [{"version": "0", "start": 0, "end": 600}]


def test_retract_across_a_weight_update_records_both_versions(make_engine, tiny_llama):
    async def main():
        engine = make_engine(tiny_llama, eos_token_ids=(0,))
        prompt = encode(engine, PROMPTS[0])
        task = asyncio.create_task(engine.generate(prompt, SamplingParams(max_new_tokens=600, seed=1)))
        await until_sampling(engine)
        await engine.pause(mode=PauseMode.RETRACT)
        split = len(engine._queue[0].token_ids)
        await engine.update_weights([("model.norm.weight", torch.full((64,), 2.0))])
        await engine.resume()
        out = await task
        await engine.close()
        return split, out

    split, out = run(main())
    assert out.meta["weight_versions"] == [{"version": "0", "start": 0, "end": split},
                                           {"version": "1", "start": split, "end": 600}]


def test_weight_update_while_paused_is_reported_in_meta(make_engine, tiny_llama):
    async def main():
        engine = make_engine(tiny_llama, eos_token_ids=(0,))
        prompt = encode(engine, PROMPTS[0])
        task = asyncio.create_task(engine.generate(prompt, SamplingParams(max_new_tokens=80, seed=1)))
        await asyncio.sleep(0.05)
        await engine.pause(mode=PauseMode.IN_PLACE)
        await engine.update_weights([("model.norm.weight", torch.full((64,), 2.0))])
        await engine.resume()
        out = await task
        await engine.close()
        return out

    out = run(main())
    assert out.meta["weight_version_start"] == 0 and out.meta["weight_version"] == 1


def test_cancelled_request_leaves_the_others_intact(make_engine, tiny_llama):
    async def main():
        engine = make_engine(tiny_llama, eos_token_ids=(0,))
        prompt = encode(engine, PROMPTS[1])
        params = SamplingParams(max_new_tokens=30, seed=2)
        reference = await engine.generate(prompt, params)
        doomed = asyncio.create_task(engine.generate(prompt, SamplingParams(max_new_tokens=500, seed=3)))
        kept = asyncio.create_task(engine.generate(prompt, params))
        await asyncio.sleep(0.05)
        doomed.cancel()
        out = await kept
        await engine.close()
        return reference, out, doomed.cancelled()

    reference, out, cancelled = run(main())
    assert cancelled and out.token_ids == reference.token_ids


def test_event_loop_stays_responsive_while_generating(make_engine, tiny_llama):
    async def main():
        engine = make_engine(tiny_llama, eos_token_ids=(0,))
        prompt = encode(engine, PROMPTS[0])
        loop = asyncio.get_running_loop()
        gaps, done = [], asyncio.Event()

        async def ticker():
            last = loop.time()
            while not done.is_set():
                await asyncio.sleep(0.002)
                now = loop.time()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        await asyncio.gather(*(engine.generate(prompt, SamplingParams(max_new_tokens=64, seed=i)) for i in range(4)))
        done.set()
        await tick
        await engine.close()
        return gaps

    gaps = run(main())
    assert len(gaps) > 10 and max(gaps) < 0.5


def test_close_aborts_in_flight_and_refuses_new_requests(make_engine, tiny_llama):
    async def main():
        engine = make_engine(tiny_llama, eos_token_ids=(0,))
        prompt = encode(engine, PROMPTS[0])
        task = asyncio.create_task(engine.generate(prompt, SamplingParams(max_new_tokens=500, seed=1)))
        await asyncio.sleep(0.05)
        await engine.close()
        out = await task
        with pytest.raises(RuntimeError, match="closed"):
            await engine.generate(prompt, SamplingParams(max_new_tokens=2))
        return out

    out = run(main())
    assert out.finish_reason is FinishReason.ABORT and len(out.token_ids) < 500


def test_bad_requests_raise_clear_errors(make_engine, tiny_llama):
    async def main():
        engine = make_engine(tiny_llama, eos_token_ids=(0,), max_seq_len=64)
        params = SamplingParams(max_new_tokens=2)
        cases = [([], "empty"), ([1, 49152], "outside the vocabulary"), ([-1], "outside the vocabulary"),
                 ("hello", "not text"), ([5] * 64, "max_seq_len")]
        for prompt, message in cases:
            with pytest.raises(ValueError, match=message):
                await engine.generate(prompt, params)
        with pytest.raises(TypeError, match="SamplingParams"):
            await engine.generate([1, 2], {"max_new_tokens": 2})
        await engine.close()

    run(main())


@pytest.mark.parametrize("overrides,message", [
    (dict(dtype="float64"), "dtype"),
    (dict(max_batch_size=0), "max_batch_size"),
    (dict(max_seq_len=1), "max_seq_len"),
    (dict(attn_implementation="flash"), "attn_implementation"),
    (dict(device="tpu"), "device"),
    (dict(eos_token_ids=(-1,)), "eos_token_ids"),
    (dict(release_idle_threads="no"), "release_idle_threads"),
    (dict(pack_weights=1), "pack_weights"),
    (dict(prefix_cache_tokens=-1), "prefix_cache_tokens"),
    (dict(prefix_cache_tokens=True), "prefix_cache_tokens"),
])
def test_config_validation(overrides, message):
    with pytest.raises(ValueError, match=message):
        LocalEngineConfig(model="smollm2", **overrides)


def test_unknown_model_is_a_clear_error(make_engine, tmp_path):
    with pytest.raises(ValueError, match="neither 'smollm2' nor an existing directory"):
        make_engine(tmp_path / "nope")


def test_using_an_engine_from_a_second_event_loop_is_a_clear_error(make_engine, tiny_llama):
    engine = make_engine(tiny_llama, eos_token_ids=(0,))
    run(engine.generate([1, 2], SamplingParams(max_new_tokens=2, seed=0)))
    with pytest.raises(RuntimeError, match="bound to the event loop"):
        run(engine.generate([1, 2], SamplingParams(max_new_tokens=2, seed=0)))


@pytest.mark.parametrize("release", [True, False])
def test_idle_openmp_teams_are_released_by_the_loading_thread_and_by_the_worker_once_idle(
        make_engine, tiny_llama, monkeypatch, release):
    """The engine hands idle OpenMP teams back (megatron_tir.rollout.engines.openmp): the building thread's once
    loaded, the worker's each time the engine runs dry -- not after every step -- and neither
    with ``release_idle_threads=False``."""
    import threading

    import megatron_tir.rollout.engines.local as local

    calls = []
    monkeypatch.setattr(local, "release_idle_threads", lambda: calls.append(threading.current_thread().name))

    async def main():
        engine = make_engine(tiny_llama, eos_token_ids=(0,), release_idle_threads=release)
        after_init = list(calls)
        prompt = encode(engine, PROMPTS[0])
        await asyncio.gather(*(engine.generate(prompt, SamplingParams(max_new_tokens=12, seed=s)) for s in range(3)))
        deadline = asyncio.get_running_loop().time() + 30  # the scheduler releases after resolving the last request
        while release and len(calls) == len(after_init) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        after_first = list(calls)
        await engine.generate(prompt, SamplingParams(max_new_tokens=12, seed=9))
        deadline = asyncio.get_running_loop().time() + 30
        while release and len(calls) == len(after_first) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        await engine.close()
        return after_init, after_first, list(calls)

    after_init, after_first, final = run(main())
    if not release:
        assert final == []
        return
    assert after_init == [threading.current_thread().name]  # the thread that built the engine
    # 3 requests x 12 steps and then 1 x 12: one release per time the engine ran dry, on its worker
    assert after_first[1:] == ["local-engine_0"]
    assert final[1:] == ["local-engine_0", "local-engine_0"]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_next_turn_reuses_the_finished_turns_cache_and_matches_a_full_forward(make_engine, tiny_llama, tiny_qwen2,
                                                                                family):
    """Turn 2 (turn 1's prompt + output + feedback) and a request sharing only the prompt take their
    leading K/V from the prefix cache; their tokens and log-probs are those of an engine without
    the cache and of a plain forward pass over the whole context."""
    model_dir = tiny_llama if family == "llama" else tiny_qwen2
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    async def main(cache_tokens):
        engine = make_engine(model_dir, eos_token_ids=(0,), prefix_cache_tokens=cache_tokens, max_batch_size=4)
        prompt = encode(engine, PROMPTS[2])
        first = await engine.generate(prompt, SamplingParams(max_new_tokens=10, seed=1))
        turn2 = prompt + first.token_ids + encode(engine, " Code Execution Result: 84\n")
        other = prompt + encode(engine, " 7 times 12")
        outs = await asyncio.gather(engine.generate(turn2, SamplingParams(max_new_tokens=8, seed=2)),
                                    engine.generate(other, SamplingParams(max_new_tokens=8, seed=3)))
        stats = None if engine.prefix_cache is None else (engine.prefix_cache.hits, engine.prefix_cache.reused_tokens)
        await engine.close()
        return prompt, first, [turn2, other], outs, stats

    prompt, first, contexts, cached, (hits, reused) = run(main(4096))
    _, first_plain, _, plain, none = run(main(0))
    assert none is None
    # turn 2 reuses all of turn 1's cached tokens (its last token was pending), the other the prompt
    assert hits == 2 and reused == (len(prompt) + len(first.token_ids) - 1) + len(prompt)
    assert first.token_ids == first_plain.token_ids
    for context, out, out_plain in zip(contexts, cached, plain, strict=True):
        assert out.token_ids == out_plain.token_ids
        ref = reference_logprobs(reference, context, out.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=0)


def test_a_request_that_ran_across_a_weight_update_is_not_cached(make_engine, tiny_llama):
    """The cache is emptied by a weight update, and a row whose K/V were partly computed under the
    old weights (held in place across the update) is not stored when it finishes; a request
    prefilled after the update is."""
    async def main():
        engine = make_engine(tiny_llama, eos_token_ids=(0,))
        prompt = encode(engine, PROMPTS[3])
        await engine.generate(prompt, SamplingParams(max_new_tokens=4, seed=0))
        stored_before = len(engine.prefix_cache)
        task = asyncio.create_task(engine.generate(prompt, SamplingParams(max_new_tokens=60, seed=4)))
        await until_sampling(engine)
        await engine.pause(mode=PauseMode.IN_PLACE)
        emb = engine.model.get_input_embeddings().weight
        await engine.update_weights([("model.embed_tokens.weight", emb + 0.01)])
        cleared = len(engine.prefix_cache)
        await engine.resume()
        across = await task
        after_across = len(engine.prefix_cache)
        await engine.generate(prompt, SamplingParams(max_new_tokens=4, seed=5))
        after_fresh = len(engine.prefix_cache)
        await engine.close()
        return stored_before, cleared, across, after_across, after_fresh

    stored_before, cleared, across, after_across, after_fresh = run(main())
    assert across.meta["weight_versions"][0]["version"] != across.meta["weight_versions"][-1]["version"]
    assert (stored_before, cleared, after_across, after_fresh) == (1, 0, 0, 1)

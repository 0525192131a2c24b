"""The slot decoder against the HF forward: same log-probs as one plain forward pass, across
rows of different lengths, rows leaving (slot moves), late joiners and capacity growth."""

from __future__ import annotations

import asyncio

import pytest
import torch
from megatron_tir.rollout.engines.base import FinishReason, SamplingParams
from megatron_tir.rollout.engines.decoders import (HFDecoder, SlotDecoder, _linear, _pack, can_pack,
                                                   supports_slot_decoder)
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from engine_testing import reference_logprobs, run


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_auto_picks_the_slot_decoder_for_llama_and_qwen2(make_engine, tiny_llama, tiny_qwen2, tiny_qwen3, family):
    engine = make_engine({"llama": tiny_llama, "qwen2": tiny_qwen2, "qwen3": tiny_qwen3}[family])
    assert supports_slot_decoder(engine.model) and isinstance(engine._decoder, SlotDecoder)
    assert isinstance(make_engine(tiny_llama, decoder="hf")._decoder, HFDecoder)


def test_qwen3_moe_runs_the_hf_forward(make_engine, tiny_qwen3_moe):
    engine = make_engine(tiny_qwen3_moe)  # routed experts: the slot decoder has no MoE MLP
    assert not supports_slot_decoder(engine.model) and isinstance(engine._decoder, HFDecoder)


@pytest.mark.parametrize("decoder,family", [("slot", "qwen2"), ("hf", "qwen2"), ("slot", "qwen3"),
                                            ("hf", "qwen3_moe")])
def test_mixed_lengths_leavers_and_late_joiners_match_a_full_forward(make_engine, tiny_qwen2, tiny_qwen3,
                                                                     tiny_qwen3_moe, decoder, family, monkeypatch):
    """Six requests through three rows: different prompt lengths and budgets (rows leave at
    different steps, so slots move), late arrivals, and a cache that must grow twice."""
    monkeypatch.setattr(SlotDecoder, "min_capacity", 8)  # growth happens within a few steps
    tiny_qwen2 = {"qwen2": tiny_qwen2, "qwen3": tiny_qwen3, "qwen3_moe": tiny_qwen3_moe}[family]
    reference = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).eval()
    texts = ["x", "def add(a, b):", "The capital of France is" * 2, "1 2 3", "Question: 12 * 7?", "hi there"]
    budgets = [23, 5, 11, 17, 3, 9]

    async def main():
        engine = make_engine(tiny_qwen2, max_batch_size=3, eos_token_ids=(0,), decoder=decoder)
        prompts = [engine.tokenizer(t).input_ids for t in texts]

        async def late(i):
            await asyncio.sleep(0.01 * i)
            return await engine.generate(prompts[i], SamplingParams(max_new_tokens=budgets[i], seed=i))

        outs = await asyncio.gather(*(late(i) for i in range(len(texts))))
        await engine.close()
        return prompts, outs

    prompts, outs = run(main())
    for prompt, out, budget in zip(prompts, outs, budgets):
        assert out.finish_reason is FinishReason.LENGTH and len(out.token_ids) == budget
        ref = reference_logprobs(reference, prompt, out.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=0)


def test_slot_and_hf_decoders_sample_the_same_tokens(make_engine, tiny_llama):
    async def main(decoder):
        engine = make_engine(tiny_llama, max_batch_size=4, eos_token_ids=(0,), decoder=decoder)
        prompts = [engine.tokenizer("a" * (1 + 3 * i)).input_ids for i in range(5)]
        outs = await asyncio.gather(*(engine.generate(p, SamplingParams(max_new_tokens=6 + 4 * i, seed=i))
                                      for i, p in enumerate(prompts)))
        await engine.close()
        return outs

    slot, hf = run(main("slot")), run(main("hf"))
    for a, b in zip(slot, hf):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("shape", [(1, 12, 8), (2, 12, 8), (5, 7, 9), (16, 6, 4)])  # (rows, out, in)
def test_split_linear_is_f_linear(threads, shape):
    """The threads' splits of a decode step's products (by output rows; by the input dimension over a
    transposed copy): F.linear's values, with and without bias, and F.linear itself where the
    rows do not split evenly or the weight is a strided view."""
    from megatron_tir.rollout.engines.decoders import _split_inner, _split_linear

    rows, out, inner = shape
    gen = torch.Generator().manual_seed(rows * 100 + out)
    x, weight, bias = (torch.randn(*s, generator=gen) for s in ((rows, inner), (out, inner), (out,)))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for b in (None, bias):
            torch.testing.assert_close(_split_linear(x, weight, b), F.linear(x, weight, b), atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(_split_inner(x, weight.t().contiguous(), b), F.linear(x, weight, b),
                                       atol=1e-5, rtol=1e-5)
        strided = torch.randn(inner, out, generator=gen).t()  # not contiguous: falls back
        torch.testing.assert_close(_split_linear(x, strided, bias), F.linear(x, strided, bias))
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.float32), reason="this torch has no oneDNN")
@pytest.mark.parametrize("rows", [1, 3, 16, 21])  # packed for 16 rows: fewer and more run on it too
def test_packed_linear_is_f_linear(rows):
    """A product over a oneDNN-packed weight: F.linear's values with and without bias, at row counts
    other than the one it was packed for; an unpacked weight goes to the split product."""
    gen = torch.Generator().manual_seed(rows)
    x, weight, bias = (torch.randn(*s, generator=gen) for s in ((rows, 96), (40, 96), (40,)))
    packed = _pack(weight, 16)
    assert packed.is_mkldnn and not weight.is_mkldnn
    for b in (None, bias):
        torch.testing.assert_close(_linear(x, packed, b), F.linear(x, weight, b), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(_linear(x, weight, b), F.linear(x, weight, b), atol=1e-6, rtol=1e-6)
    assert torch.equal(_linear(x[:1], packed, bias), _linear(x, packed, bias)[:1])  # a row's value ignores the others


def test_the_slot_decoder_packs_only_where_steps_can_use_it(tiny_qwen2):
    """Packed copies exist for an engine built for more than `small_rows` rows, in float32 on CPU, and
    then no transposed copies (one set of copies, never both); a decoder built for at most
    `small_rows` rows, pack=False or bfloat16 keeps the transposed copies instead."""
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).eval()
    cpu = torch.device("cpu")
    expected = can_pack(cpu, torch.float32)
    decoder = SlotDecoder(model, cpu, max_rows=4)
    assert (decoder.packed is not None) is expected and (decoder.packed_lm_head is not None) is expected
    assert (decoder.small is None) is expected and (decoder.small_lm_head is None) is expected
    for other in (SlotDecoder(model, cpu, max_rows=SlotDecoder.small_rows), SlotDecoder(model, cpu, max_rows=4, pack=False)):
        assert other.packed is None and other.small is not None
    assert not can_pack(cpu, torch.bfloat16) and not can_pack(torch.device("meta"), torch.float32)


@pytest.mark.parametrize("pack", [True, False])
def test_a_weight_update_refreshes_only_the_copies_of_the_weights_it_wrote(tiny_qwen2, pack):
    """weights_changed(tensors) marks the packed (or transposed) copies whose weight shares memory
    with a written tensor (q_proj's weight is a view of the fused q/k/v); refresh() (the next step)
    rebuilds those and leaves the others alone; weights_changed() marks all."""
    if pack and not can_pack(torch.device("cpu"), torch.float32):
        pytest.skip("this torch has no oneDNN")
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).eval().requires_grad_(False)
    decoder = SlotDecoder(model, torch.device("cpu"), max_rows=4, pack=pack)
    copies = decoder.packed if pack else decoder.small
    before = [list(c) for c in copies]
    values = [[c.to_dense().clone() if c.is_mkldnn else c.clone() for c in layer] for layer in copies]
    q = model.model.layers[1].self_attn.q_proj.weight
    down = model.model.layers[0].mlp.down_proj.weight
    with torch.no_grad():
        q.add_(1.0)
        down.add_(1.0)  # written but not named: its copy must stay as it was
        model.model.layers[0].self_attn.o_proj.weight.add_(1.0)
    decoder.weights_changed([q])
    decoder.weights_changed([q])  # twice (two buckets): one rebuild
    lazy = decoder.packed if pack else decoder.small
    for layer, layer_copies in enumerate(lazy):  # nothing rebuilt before the next step
        for j, copy in enumerate(layer_copies):
            assert copy is before[layer][j]
            assert torch.equal(copy.to_dense() if copy.is_mkldnn else copy, values[layer][j]), (layer, j)
    decoder.refresh()
    after = decoder.packed if pack else decoder.small
    for layer, layer_copies in enumerate(after):
        for j, copy in enumerate(layer_copies):
            dense = copy.to_dense() if copy.is_mkldnn else copy
            assert torch.equal(dense, values[layer][j]) is ((layer, j) != (1, 0)), (layer, j)
            if pack:
                assert (copy is before[layer][j]) is ((layer, j) != (1, 0))
    x = torch.randn(3, model.config.hidden_size)
    qkv_w, qkv_b = decoder.fused[1][0]
    got = _linear(x, after[1][0], qkv_b) if pack else x @ after[1][0] + qkv_b
    torch.testing.assert_close(got, F.linear(x, qkv_w, qkv_b), atol=1e-5, rtol=1e-5)
    decoder.weights_changed()  # all: the o_proj copy of layer 0 catches up at the next step
    decoder.prefill(None, [[1, 2, 3]])
    o = model.model.layers[0].self_attn.o_proj.weight
    refreshed = (decoder.packed if pack else decoder.small)[0][1]
    x = torch.randn(3, o.shape[1])
    got = _linear(x, refreshed, None) if pack else x @ refreshed
    torch.testing.assert_close(got, F.linear(x, o), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_ragged_prefill_and_its_slots_match_the_hf_forward(tiny_llama, tiny_qwen2, tiny_qwen3, family, pack):
    """The slot decoder's prefill (contexts of different lengths in one ragged batch, no padding)
    gives each context's last-position logits as a plain HF forward of that context alone, rows
    prefilled later join the running ones, and the slots it filled decode the next token as the HF
    forward over context + token does."""
    model = AutoModelForCausalLM.from_pretrained({"llama": tiny_llama, "qwen2": tiny_qwen2, "qwen3": tiny_qwen3}[family],
                                                 dtype=torch.float32).eval()
    decoder = SlotDecoder(model, torch.device("cpu"), max_rows=4, pack=pack)
    gen = torch.Generator().manual_seed(0)
    contexts = [torch.randint(1, 200, (n,), generator=gen).tolist() for n in (5, 1, 12, 3)]

    def hf_last(ids: list[int]) -> torch.Tensor:
        return model(input_ids=torch.tensor([ids])).logits[0, -1]

    with torch.inference_mode():
        state, first = decoder.prefill(None, contexts[:3])
        state, late = decoder.prefill(state, contexts[3:])
        assert state.lengths == [len(c) for c in contexts]
        for ids, got in zip(contexts, [*first, *late], strict=True):
            torch.testing.assert_close(got, hf_last(ids), atol=1e-4, rtol=1e-4)
        tokens = torch.tensor([7, 8, 9, 10])
        stepped = decoder.decode(state, tokens)
        for ids, token, got in zip(contexts, tokens.tolist(), stepped, strict=True):
            torch.testing.assert_close(got, hf_last(ids + [token]), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("pack", [True, False])
def test_prefill_reusing_cached_and_sibling_prefixes_matches_the_hf_forward(tiny_qwen2, pack):
    """Contexts whose first tokens' K/V come from a cached row (PrefixCache's entries) or from an
    earlier context of the same prefill give the last-position logits of a plain HF forward of the
    whole context, and their slots decode the next token as the HF forward does; a reuse that leaves
    nothing to compute, or names a later context, is refused."""
    from megatron_tir.rollout.engines.prefix_cache import CachedPrefix

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).eval()
    decoder = SlotDecoder(model, torch.device("cpu"), max_rows=4, pack=pack)
    gen = torch.Generator().manual_seed(1)
    base = torch.randint(1, 200, (9,), generator=gen).tolist()

    def hf_last(ids: list[int]) -> torch.Tensor:
        return model(input_ids=torch.tensor([ids])).logits[0, -1]

    with torch.inference_mode():
        state, _ = decoder.prefill(None, [base])
        keys, values = SlotDecoder.row_kv(state, 0)
        assert keys.shape[2] == len(base)
        entry = CachedPrefix(tokens=base, keys=keys, values=values)
        turn2 = base + [5, 6, 7]  # the cached row's tokens, then feedback
        sibling = base[:6] + [9, 9]  # shares 6 tokens with the cached row and with turn2
        fresh = torch.randint(1, 200, (4,), generator=gen).tolist()
        contexts = [turn2, fresh, sibling[:4] + [1], sibling]
        reuse = [(entry, len(base)), None, (0, 4), (0, 6)]
        state, logits = decoder.prefill(None, contexts, reuse=reuse)
        for ids, got in zip(contexts, logits, strict=True):
            torch.testing.assert_close(got, hf_last(ids), atol=1e-4, rtol=1e-4)
        tokens = torch.tensor([3, 4, 5, 6])
        stepped = decoder.decode(state, tokens)
        for ids, token, got in zip(contexts, tokens.tolist(), stepped, strict=True):
            torch.testing.assert_close(got, hf_last(ids + [token]), atol=1e-4, rtol=1e-4)
        with pytest.raises(ValueError, match="bad reuse"):
            decoder.prefill(None, [base], reuse=[(entry, len(base))])
        with pytest.raises(ValueError, match="bad reuse"):
            decoder.prefill(None, [base, base], reuse=[(1, 3), None])

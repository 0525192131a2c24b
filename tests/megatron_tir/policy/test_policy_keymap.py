"""Key maps and transforms against hand-built expectations (no megatron needed)."""

from __future__ import annotations

import pytest
import torch

from megatron_tir.policy import keymap
from tiny_models import tiny_config
from megatron_tir.policy.spec import ModelSpec


def _spec(family="qwen2", **kw):
    return ModelSpec.from_hf(tiny_config(family, num_heads=6, num_kv_heads=2, hidden_size=48, **kw))


def test_qkv_interleave_by_query_group_matches_hand_layout():
    spec = _spec()  # 6 query heads, 2 groups -> 3 heads per group, head_dim 8
    d = spec.head_dim
    # Each row holds its (kind, head) id so the layout can be read back.
    q = torch.arange(6).repeat_interleave(d).float().unsqueeze(1) + 100  # heads 100..105
    k = torch.arange(2).repeat_interleave(d).float().unsqueeze(1) + 200
    v = torch.arange(2).repeat_interleave(d).float().unsqueeze(1) + 300
    p = next(p for p in keymap.plan(spec) if p.megatron == "decoder.layers.0.self_attention.linear_qkv.weight")
    fused = keymap.to_megatron(p, [q, k, v], spec)
    heads = fused[::d, 0].tolist()
    assert heads == [100, 101, 102, 200, 300, 103, 104, 105, 201, 301]


def test_gate_up_is_gate_then_up():
    spec = _spec("llama")
    p = next(p for p in keymap.plan(spec) if p.megatron.endswith("0.mlp.linear_fc1.weight"))
    gate, up = torch.zeros(128, 48), torch.ones(128, 48)
    fused = keymap.to_megatron(p, [gate, up], spec)
    assert fused.shape == (256, 48) and fused[:128].sum() == 0 and fused[128:].sum() == 128 * 48


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("tied", [True, False])
def test_transforms_invert_exactly(family, tied):
    spec = _spec(family, tie_word_embeddings=tied)
    torch.manual_seed(0)
    for p in keymap.plan(spec):
        hf = [torch.randn(s) for s in p.hf_shapes]
        meg = keymap.to_megatron(p, hf, spec)
        assert tuple(meg.shape) == p.megatron_shape
        back = keymap.to_hf(p, meg, spec)
        assert all(torch.equal(a, b) and b.is_contiguous() for a, b in zip(hf, back))


def test_plan_covers_every_hf_tensor_of_the_family(make_tiny_hf):
    from safetensors import safe_open

    for family, tied in [("llama", True), ("qwen2", False), ("qwen3", False), ("qwen3_moe", False)]:
        hf_dir = make_tiny_hf(family, tie_word_embeddings=tied)
        spec = ModelSpec.from_hf(tiny_config(family, tie_word_embeddings=tied))
        with safe_open(hf_dir / "model.safetensors", "pt") as f:
            names = set(f.keys()) - ({"lm_head.weight"} if tied else set())
        planned = {n for p in keymap.plan(spec) for n in p.hf}
        assert planned == names
        assert ("lm_head.weight" in planned) == (not tied)
        assert any(n.endswith("q_proj.bias") for n in planned) == (family == "qwen2")
        assert any(n.endswith("self_attn.k_norm.weight") for n in planned) == family.startswith("qwen3")


def test_tables_are_readable_markdown():
    for family in keymap.KEY_MAPS:
        table = keymap.table(family)
        assert table.count("\n") == len(keymap.KEY_MAPS[family]) + 1
        assert "linear_qkv" in table and "qkv" in table and "gate_up" in table
    assert "q_proj.bias" in keymap.table("qwen2") and "q_proj.bias" not in keymap.table("llama")
    assert "q_norm" in keymap.table("qwen3") and "q_proj.bias" not in keymap.table("qwen3")
    with pytest.raises(ValueError):
        keymap.table("gpt2")


def test_qwen3_qk_norms_are_per_head_and_kept_apart():
    spec = ModelSpec.from_hf(tiny_config("qwen3", head_dim=32))
    plans = {p.megatron: p for p in keymap.plan(spec)}
    q = plans["decoder.layers.1.self_attention.q_layernorm.weight"]
    k = plans["decoder.layers.1.self_attention.k_layernorm.weight"]
    assert q.hf == ("model.layers.1.self_attn.q_norm.weight",) and k.hf == ("model.layers.1.self_attn.k_norm.weight",)
    assert q.hf_shapes == ((32,),) and k.megatron_shape == (32,)  # head_dim, not hidden
    qkv = plans["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.hf_shapes == ((128, 64), (64, 64), (64, 64)) and qkv.megatron_shape == (256, 64)


def test_qwen3_moe_expert_names_both_ways():
    spec = ModelSpec.from_hf(tiny_config("qwen3_moe", num_experts=8, moe_intermediate_size=32))
    plans = {p.megatron: p for p in keymap.plan(spec)}
    fc1 = plans["decoder.layers.1.mlp.experts.local_experts.5.linear_fc1.weight"]
    assert fc1.hf == ("model.layers.1.mlp.experts.5.gate_proj.weight", "model.layers.1.mlp.experts.5.up_proj.weight")
    assert fc1.transform == "gate_up" and fc1.hf_shapes == ((32, 64), (32, 64)) and fc1.megatron_shape == (64, 64)
    fc2 = plans["decoder.layers.1.mlp.experts.local_experts.5.linear_fc2.weight"]
    assert fc2.hf == ("model.layers.1.mlp.experts.5.down_proj.weight",) and fc2.megatron_shape == (64, 32)
    assert plans["decoder.layers.0.mlp.router.weight"].hf == ("model.layers.0.mlp.gate.weight",)
    assert plans["decoder.layers.0.mlp.router.weight"].megatron_shape == (8, 64)
    assert sum("local_experts" in n for n in plans) == 2 * 2 * 8  # layers x (fc1, fc2) x experts
    # the grouped-GEMM (TE) name of the same tensor, and where a checkpoint stores it
    assert fc1.sharded == "decoder.layers.1.mlp.experts.linear_fc1.weight5"
    assert keymap.local_name(fc1.sharded) == fc1.megatron
    assert fc1.stored == ("decoder.layers.mlp.experts.experts.linear_fc1.weight", (1, 5))
    # an MoE layer's pre-MLP norm is its own module in both specs (no fused linear_fc1 to hold it)
    norm = plans["decoder.layers.0.pre_mlp_layernorm.weight"]
    assert norm.hf == ("model.layers.0.post_attention_layernorm.weight",)
    assert norm.stored == ("decoder.layers.pre_mlp_layernorm.weight", (0,))
    dense = next(p for p in keymap.plan(_spec("qwen3")) if p.megatron == "decoder.layers.0.pre_mlp_layernorm.weight")
    assert dense.stored == ("decoder.layers.mlp.linear_fc1.layer_norm_weight", (0,))
    # a stage's local expert index + its expert-parallel offset = the global index
    local = "decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight"
    assert keymap.expert_offset(local, 4) == "decoder.layers.1.mlp.experts.local_experts.5.linear_fc2.weight"
    assert keymap.expert_offset("decoder.layers.1.mlp.router.weight", 4) == "decoder.layers.1.mlp.router.weight"
    with pytest.raises(ValueError, match="stored_key"):
        keymap.sharded_key(fc1.megatron)

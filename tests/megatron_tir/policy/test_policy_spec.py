"""ModelSpec from HF configs, and the TransformerConfig/GPTModel it builds."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from tiny_models import tiny_config
from megatron_tir.policy.spec import ModelSpec


def test_smollm2_config(smollm2_dir):
    spec = ModelSpec.from_hf(AutoConfig.from_pretrained(smollm2_dir))
    assert (spec.family, spec.num_layers, spec.hidden_size, spec.num_attention_heads, spec.num_query_groups) == (
        "llama", 30, 576, 9, 3)
    assert spec.head_dim == 64 and spec.ffn_hidden_size == 1536 and spec.vocab_size == 49152
    assert spec.rotary_base == 100000.0 and spec.tie_word_embeddings and not spec.qkv_bias


@pytest.mark.parametrize("tied", [True, False])
def test_qwen2_has_qkv_bias(tied):
    spec = ModelSpec.from_hf(tiny_config("qwen2", tie_word_embeddings=tied))
    assert spec.family == "qwen2" and spec.qkv_bias and spec.tie_word_embeddings == tied
    assert ModelSpec.from_dict(spec.to_dict()) == spec


@pytest.mark.parametrize("change,message", [
    (dict(model_type="gpt2", architectures=["GPT2LMHeadModel"]), "unsupported architecture"),
    (dict(architectures=["LlamaForSequenceClassification"]), "unsupported architecture"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}), "rope scaling"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(num_key_value_heads=3), "not a multiple"),
])
def test_unsupported_configs_are_refused(change, message):
    cfg = tiny_config("llama").to_dict()
    cfg.update(change)
    with pytest.raises(ValueError, match=message):
        ModelSpec.from_hf(cfg)


def test_layout_checks():
    spec = ModelSpec.from_hf(tiny_config("llama", num_heads=4, num_kv_heads=2))
    spec.check_layout(2, 2)
    with pytest.raises(ValueError, match="key/value heads"):
        ModelSpec.from_hf(tiny_config("llama", num_heads=4, num_kv_heads=1)).check_layout(2, 1)
    with pytest.raises(ValueError, match="number of layers"):
        spec.check_layout(1, 3)
    with pytest.raises(ValueError, match="must be >= 1"):
        spec.check_layout(0, 1)


def test_transformer_config_matches_the_hf_model():
    spec = ModelSpec.from_hf(tiny_config("qwen2", num_heads=4, num_kv_heads=2))
    tc = spec.transformer_config()
    assert tc.normalization == "RMSNorm" and tc.gated_linear_unit and tc.add_qkv_bias and not tc.add_bias_linear
    assert tc.num_query_groups == 2 and tc.kv_channels == 16 and tc.ffn_hidden_size == 128
    assert tc.hidden_dropout == 0 and tc.attention_dropout == 0 and tc.layernorm_epsilon == 1e-5
    assert tc.activation_func is torch.nn.functional.silu


def test_build_gpt_model_tp1(make_tiny_hf):
    from megatron_tir.policy.build import build_gpt_model
    from megatron_tir.policy.parallel import init_parallel

    spec = ModelSpec.from_hf(tiny_config("qwen2", tie_word_embeddings=False))
    init_parallel(1, 1)
    model = build_gpt_model(spec)
    sd = model.state_dict()
    assert sd["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (4 * 16 + 2 * 2 * 16, 64)
    assert sd["decoder.layers.0.self_attention.linear_qkv.bias"].shape == (128,)
    assert sd["output_layer.weight"].shape == (49152, 64)
    assert not model.decoder.layers[0].self_attention.config.rotary_interleaved
    assert model.rotary_pos_emb.inv_freq[1].item() == pytest.approx(10000.0 ** (-2 / 16))


@pytest.mark.parametrize("tied", [True, False])
def test_qwen3_has_qk_norm_and_no_qkv_bias(tied):
    spec = ModelSpec.from_hf(tiny_config("qwen3", tie_word_embeddings=tied, head_dim=32))
    assert spec.family == "qwen3" and spec.qk_layernorm and not spec.qkv_bias and not spec.is_moe
    assert spec.head_dim == 32 and spec.hidden_size == 64 and spec.tie_word_embeddings == tied
    assert ModelSpec.from_dict(spec.to_dict()) == spec
    tc = spec.transformer_config()
    assert tc.qk_layernorm and not tc.add_qkv_bias and tc.kv_channels == 32 and tc.num_moe_experts is None


def test_qwen3_moe_spec_and_its_megatron_router():
    spec = ModelSpec.from_hf(tiny_config("qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                         norm_topk_prob=True))
    assert spec.is_moe and spec.qk_layernorm and (spec.num_experts, spec.moe_router_topk) == (8, 2)
    assert spec.moe_ffn_hidden_size == 32 and spec.norm_topk_prob and spec.router_aux_loss_coef == 0.001
    tc = spec.transformer_config()
    assert (tc.num_moe_experts, tc.moe_router_topk, tc.moe_ffn_hidden_size) == (8, 2, 32)
    # renormalised top-k == softmax over the k chosen logits (top-k first); else softmax first
    assert not tc.moe_router_pre_softmax and tc.moe_router_score_function == "softmax"
    assert tc.moe_aux_loss_coeff == 0.001 and tc.moe_token_dispatcher_type == "allgather"
    raw = ModelSpec.from_hf(tiny_config("qwen3_moe", norm_topk_prob=False))
    assert raw.transformer_config().moe_router_pre_softmax
    spec.check_layout(2, 1, ep=2)
    with pytest.raises(ValueError, match="experts"):
        spec.check_layout(1, 1, ep=3)
    with pytest.raises(ValueError, match="expert ffn"):
        spec.check_layout(1, 1, ep=1, etp=3)
    with pytest.raises(ValueError, match="dense"):
        ModelSpec.from_hf(tiny_config("qwen3")).check_layout(1, 1, ep=2)


@pytest.mark.parametrize("family,change,message", [
    ("qwen3", dict(use_sliding_window=True), "sliding"),
    ("qwen3", dict(attention_bias=True), "attention_bias"),
    ("qwen3_moe", dict(mlp_only_layers=[0]), "dense layers"),
    ("qwen3_moe", dict(decoder_sparse_step=2), "dense layers"),
    ("qwen3_moe", dict(num_experts_per_tok=9), "moe_router_topk"),
])
def test_unsupported_qwen3_configs_are_refused(family, change, message):
    cfg = tiny_config(family).to_dict()
    cfg.update(change)
    with pytest.raises(ValueError, match=message):
        ModelSpec.from_hf(cfg)

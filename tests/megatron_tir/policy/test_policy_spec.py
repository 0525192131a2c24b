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

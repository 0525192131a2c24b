"""Named model sources: the tiny random Qwen2 is the same model wherever it is materialised."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from megatron_tir.model_sources import TINY_QWEN2_CONFIG, materialize_tiny_qwen2, resolve_model


def test_tiny_qwen2_is_deterministic_and_uses_smollm2s_tokenizer(tmp_path, smollm2_dir):
    from transformers import AutoConfig, AutoTokenizer

    a = materialize_tiny_qwen2(tmp_path / "a")
    b = materialize_tiny_qwen2(tmp_path / "b")
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)
    assert "model.layers.0.self_attn.q_proj.bias" in wa and "lm_head.weight" in wa
    other = load_file(materialize_tiny_qwen2(tmp_path / "c", seed=1) / "model.safetensors")
    assert not (other["lm_head.weight"] == wa["lm_head.weight"]).all()
    config = AutoConfig.from_pretrained(a)
    assert config.model_type == "qwen2" and config.hidden_size == TINY_QWEN2_CONFIG["hidden_size"]
    text = "print(1 + 2)"
    assert AutoTokenizer.from_pretrained(a)(text).input_ids == AutoTokenizer.from_pretrained(smollm2_dir)(text).input_ids


def test_unknown_name_is_refused(tmp_path):
    with pytest.raises(ValueError, match="named models: smollm2, tiny-qwen2"):
        resolve_model("tiny-llama")

"""Tiny random HF model configs for tests (Llama, and Qwen2 with its qkv bias)."""

from __future__ import annotations


def tiny_config(family: str = "llama", *, tie_word_embeddings: bool = True, vocab_size: int = 49152,
                hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                intermediate_size: int = 128):
    """A tiny random Llama or Qwen2 config (Qwen2 has qkv bias) for tests."""
    from transformers import LlamaConfig, Qwen2Config

    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                  num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  intermediate_size=intermediate_size, max_position_embeddings=2048,
                  tie_word_embeddings=tie_word_embeddings, rms_norm_eps=1e-5, rope_theta=10000.0)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "qwen2":
        return Qwen2Config(**common)
    raise ValueError(f"unknown tiny model family {family!r} (llama, qwen2)")

"""Tiny random HF model configs for tests (Llama; Qwen2 with its qkv bias; Qwen3 with QK-norm and a
head width other than hidden/heads; Qwen3-MoE)."""

from __future__ import annotations

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")


def tiny_config(family: str = "llama", *, tie_word_embeddings: bool = True, vocab_size: int = 49152,
                hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                intermediate_size: int = 128, head_dim: int | None = None, num_experts: int = 8,
                num_experts_per_tok: int = 2, moe_intermediate_size: int = 32, norm_topk_prob: bool = True):
    """A tiny random config of ``family`` for tests. Qwen3 and Qwen3-MoE default to ``head_dim`` 32
    (queries 4 x 32 = 128 wide on a 64-wide model, as Qwen3's own head_dim is not hidden/heads)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                  num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  intermediate_size=intermediate_size, max_position_embeddings=2048,
                  tie_word_embeddings=tie_word_embeddings, rms_norm_eps=1e-5, rope_theta=10000.0)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "qwen2":
        return Qwen2Config(**common)
    if family == "qwen3":
        return Qwen3Config(**common, head_dim=head_dim or 32)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(**common, head_dim=head_dim or 32, num_experts=num_experts,
                              num_experts_per_tok=num_experts_per_tok, moe_intermediate_size=moe_intermediate_size,
                              norm_topk_prob=norm_topk_prob, router_aux_loss_coef=0.001)
    raise ValueError(f"unknown tiny model family {family!r} ({', '.join(FAMILIES)})")

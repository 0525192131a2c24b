"""The shapes of the recipes' cluster models, from their HF ``config.json`` (no download at plan time).

The capacity planner needs layers, widths and head counts; the models themselves live on the
cluster. These are the keys of each model's HF config that ``ModelSpec.from_hf`` reads, copied
from the files named in ``source`` (Hugging Face, revision ``main``, read 2026-12). Models not
listed here are read from their ``config.json`` when the name is a local directory (or one of
the project's own: ``smollm2``, ``tiny-qwen2``).
"""

from __future__ import annotations

HF_CONFIGS: dict[str, dict] = {
    "Qwen2.5-7B": {
        "source": "https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json",
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
        "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
        "max_position_embeddings": 131072, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False, "use_sliding_window": False, "torch_dtype": "bfloat16",
    },
    "Qwen2.5-32B": {
        "source": "https://huggingface.co/Qwen/Qwen2.5-32B/blob/main/config.json",
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
        "hidden_size": 5120, "intermediate_size": 27648, "num_hidden_layers": 64,
        "num_attention_heads": 40, "num_key_value_heads": 8, "vocab_size": 152064,
        "max_position_embeddings": 131072, "rope_theta": 1000000.0, "rms_norm_eps": 1e-05,
        "tie_word_embeddings": False, "use_sliding_window": False, "torch_dtype": "bfloat16",
    },
    # Qwen3 (2025): QK-norm, no qkv bias, head_dim 128 (not hidden/heads); the -Base checkpoints that
    # zero RL starts from have the same shapes. Cross-checked with slime's scripts/models/qwen3-*.sh.
    "Qwen3-8B": {
        "source": "https://huggingface.co/Qwen/Qwen3-8B/blob/main/config.json",
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
        "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "head_dim": 128,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 151936,
        "max_position_embeddings": 40960, "rope_theta": 1000000, "rms_norm_eps": 1e-06, "attention_bias": False,
        "tie_word_embeddings": False, "use_sliding_window": False, "torch_dtype": "bfloat16",
    },
    "Qwen3-14B": {
        "source": "https://huggingface.co/Qwen/Qwen3-14B/blob/main/config.json",
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
        "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 40, "head_dim": 128,
        "num_attention_heads": 40, "num_key_value_heads": 8, "vocab_size": 151936,
        "max_position_embeddings": 40960, "rope_theta": 1000000, "rms_norm_eps": 1e-06, "attention_bias": False,
        "tie_word_embeddings": False, "use_sliding_window": False, "torch_dtype": "bfloat16",
    },
    "Qwen3-32B": {
        "source": "https://huggingface.co/Qwen/Qwen3-32B/blob/main/config.json",
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
        "hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64, "head_dim": 128,
        "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 151936,
        "max_position_embeddings": 40960, "rope_theta": 1000000, "rms_norm_eps": 1e-06, "attention_bias": False,
        "tie_word_embeddings": False, "use_sliding_window": False, "torch_dtype": "bfloat16",
    },
    # Qwen3-MoE: 128 experts of width 768, 8 active (renormalised), every layer an MoE layer, no shared expert
    "Qwen3-30B-A3B": {
        "source": "https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json",
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_act": "silu",
        "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48, "head_dim": 128,
        "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 151936,
        "max_position_embeddings": 40960, "rope_theta": 1000000, "rms_norm_eps": 1e-06, "attention_bias": False,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
        "router_aux_loss_coef": 0.001, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "tie_word_embeddings": False, "use_sliding_window": False, "torch_dtype": "bfloat16",
    },
}


def model_spec(name: str):
    """The ``ModelSpec`` of a recipe's model: the facts above, else the local HF directory's config;
    ValueError when neither is known."""
    from pathlib import Path

    from megatron_tir.policy.spec import ModelSpec, spec_from_hf_dir

    if name in HF_CONFIGS:
        return ModelSpec.from_hf({k: v for k, v in HF_CONFIGS[name].items() if k != "source"})
    if name in ("smollm2", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe") or (Path(name) / "config.json").is_file():
        from megatron_tir.model_sources import resolve_model

        return spec_from_hf_dir(resolve_model(name))[0]
    raise ValueError(f"no shape known for model {name!r} (megatron_tir/launch/model_facts.py lists "
                     f"{', '.join(HF_CONFIGS)}; or give a local HF directory)")

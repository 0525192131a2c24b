"""What the policy model is: a typed description derived from a HuggingFace config.

``ModelSpec.from_hf(config)`` accepts the dense decoder families this project trains
(Llama, e.g. SmolLM2; Qwen2 / Qwen2.5) and refuses anything it would convert wrongly
(another architecture, rope scaling, sliding window, biases Megatron's layer would not
hold). ``ModelSpec.transformer_config()`` turns it into megatron-core's
``TransformerConfig``: RMSNorm, SwiGLU, rotary embeddings (non-interleaved, the HF
``rotate_half`` convention), grouped-query attention, qkv bias for Qwen2, no dropout.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# HF ``model_type`` -> family name used by the key maps (``megatron_tir.policy.keymap``).
FAMILIES = {"llama": "llama", "qwen2": "qwen2"}
_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelSpec:
    """A dense Llama-style decoder (the subset of HF configs Megatron's GPTModel reproduces exactly)."""

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    max_position_embeddings: int
    rotary_base: float
    norm_epsilon: float
    qkv_bias: bool
    tie_word_embeddings: bool
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.family not in FAMILIES.values():
            raise ValueError(f"unknown model family {self.family!r} (known: {sorted(FAMILIES.values())})")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_query_groups",
                     "head_dim", "ffn_hidden_size", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                             f"num_key_value_heads ({self.num_query_groups})")
        if self.rotary_base <= 0 or self.norm_epsilon <= 0:
            raise ValueError("rotary_base and norm_epsilon must be positive")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype {self.dtype!r} not supported (known: {sorted(_DTYPES)})")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    def check_layout(self, tp: int, pp: int) -> None:
        """ValueError unless this model splits evenly over ``tp`` x ``pp`` ranks."""
        if tp < 1 or pp < 1:
            raise ValueError(f"tp and pp must be >= 1, got tp={tp} pp={pp}")
        for what, n in (("attention heads", self.num_attention_heads),
                        ("key/value heads", self.num_query_groups),
                        ("vocab size", self.vocab_size),
                        ("ffn hidden size", self.ffn_hidden_size)):
            if n % tp:
                raise ValueError(f"tp={tp} does not divide the {what} ({n})")
        if self.num_layers % pp:
            raise ValueError(f"pp={pp} does not divide the number of layers ({self.num_layers})")

    @classmethod
    def from_hf(cls, config: Any) -> ModelSpec:
        """From a ``transformers`` config object or its ``to_dict()``; ValueError if unsupported."""
        cfg = config if isinstance(config, dict) else config.to_dict()
        model_type = cfg.get("model_type")
        archs = cfg.get("architectures") or []
        if model_type not in FAMILIES:
            raise ValueError(f"unsupported architecture: model_type={model_type!r} architectures={archs} "
                             f"(supported: {sorted(_ARCHITECTURES)})")
        family = FAMILIES[model_type]
        unknown = [a for a in archs if a not in _ARCHITECTURES]
        if unknown:
            raise ValueError(f"unsupported architecture {unknown[0]!r} (supported: {sorted(_ARCHITECTURES)})")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg.get('hidden_act')!r} is not supported (SwiGLU/silu only)")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in (None, "default"):
            raise ValueError(f"rope scaling {rope_type!r} is not supported (default rotary embedding only)")
        rotary_base = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        if family == "llama":
            if cfg.get("attention_bias") or cfg.get("mlp_bias"):
                raise ValueError("Llama with attention_bias/mlp_bias is not supported")
            qkv_bias = False
        else:
            if cfg.get("use_sliding_window"):
                raise ValueError("Qwen2 with use_sliding_window=true is not supported")
            qkv_bias = True
        hidden = cfg["hidden_size"]
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or hidden // heads
        dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        if isinstance(dtype, torch.dtype):
            dtype = str(dtype).removeprefix("torch.")
        return cls(
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            num_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_query_groups=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            ffn_hidden_size=cfg["intermediate_size"],
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rotary_base=float(rotary_base),
            norm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)),
            qkv_bias=qkv_bias,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            dtype=dtype,
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelSpec:
        return cls(**d)

    def transformer_config(self, *, tp: int = 1, pp: int = 1, **overrides: Any):
        """megatron-core ``TransformerConfig`` for this model at tensor/pipeline sizes ``tp``/``pp``."""
        import torch.nn.functional as F
        from megatron.core.transformer import TransformerConfig

        self.check_layout(tp, pp)
        on_gpu = torch.cuda.is_available()
        kwargs: dict[str, Any] = dict(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            ffn_hidden_size=self.ffn_hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_query_groups,
            kv_channels=self.head_dim,
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            normalization="RMSNorm",
            layernorm_epsilon=self.norm_epsilon,
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=self.qkv_bias,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            params_dtype=self.torch_dtype,
            pipeline_dtype=self.torch_dtype,
            bf16=self.torch_dtype == torch.bfloat16,
            fp16=self.torch_dtype == torch.float16,
            attention_softmax_in_fp32=True,
            use_cpu_initialization=not on_gpu,
            # fused CUDA kernels are unavailable without a GPU
            bias_activation_fusion=on_gpu,
            masked_softmax_fusion=on_gpu,
            apply_rope_fusion=False,
            gradient_accumulation_fusion=False,
            persist_layer_norm=False,
        )
        kwargs.update(overrides)
        return TransformerConfig(**kwargs)


def read_hf_config(hf_dir: Path) -> dict:
    """config.json of an HF dir, verbatim; ValueError for unknown architectures.

    Read as JSON (not through transformers' AutoConfig, whose import costs more than a
    small model's conversion); ``ModelSpec.from_hf`` knows both the transformers 4
    (``rope_theta``, ``torch_dtype``) and 5 (``rope_parameters``, ``dtype``) spellings.
    """
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{hf_dir} has no config.json")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict) or raw.get("model_type") not in FAMILIES:
        model_type = raw.get("model_type") if isinstance(raw, dict) else None
        raise ValueError(f"unsupported architecture: model_type={model_type!r} "
                         f"architectures={raw.get('architectures') if isinstance(raw, dict) else None} "
                         f"(supported: llama, qwen2)")
    return raw


def spec_from_hf_dir(hf_dir: Path) -> tuple[ModelSpec, dict]:
    config = read_hf_config(hf_dir)
    return ModelSpec.from_hf(config), config

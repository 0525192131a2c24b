"""What the policy model is: a typed description derived from a HuggingFace config.

``ModelSpec.from_hf(config)`` accepts the decoder families this project trains (Llama,
e.g. SmolLM2; Qwen2 / Qwen2.5; Qwen3 dense; Qwen3-MoE) and refuses anything it would convert
wrongly (another architecture, rope scaling, sliding window, biases Megatron's layer would
not hold, MoE models with dense layers in between). ``ModelSpec.transformer_config()`` turns
it into megatron-core's ``TransformerConfig``: RMSNorm, SwiGLU, rotary embeddings
(non-interleaved, the HF ``rotate_half`` convention), grouped-query attention, qkv bias for
Qwen2, per-head RMSNorm of queries and keys before the rotary embedding for Qwen3
(``qk_layernorm``), no dropout; for Qwen3-MoE megatron-core's MoE layer (``moe.py``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# HF ``model_type`` -> family name used by the key maps (``megatron_tir.policy.keymap``).
FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe"}
_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                  "Qwen3MoeForCausalLM": "qwen3_moe"}
QK_NORM_FAMILIES = ("qwen3", "qwen3_moe")
MOE_FAMILIES = ("qwen3_moe",)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelSpec:
    """A Llama-style decoder (the subset of HF configs Megatron's GPTModel reproduces exactly).

    ``qk_layernorm``: queries and keys are RMS-normalised per head (Qwen3). MoE models
    (``num_experts > 0``) have a routed-experts MLP in every layer: ``moe_router_topk`` of
    ``num_experts`` experts of width ``moe_ffn_hidden_size`` per token; ``norm_topk_prob``
    renormalises the chosen experts' softmax probabilities to sum to 1 (else they are the
    softmax over all experts); ``router_aux_loss_coef`` is the model's load-balancing
    coefficient (the training default; a learner setting may replace it).
    """

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
    qk_layernorm: bool = False
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    moe_router_topk: int = 0
    norm_topk_prob: bool = False
    router_aux_loss_coef: float = 0.0

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
        if (self.family in MOE_FAMILIES) != (self.num_experts > 0):
            raise ValueError(f"family {self.family!r} with num_experts={self.num_experts}: MoE families "
                             f"({', '.join(MOE_FAMILIES)}) need experts, the others have none")
        if self.num_experts:
            if self.moe_ffn_hidden_size <= 0:
                raise ValueError(f"moe_ffn_hidden_size must be positive, got {self.moe_ffn_hidden_size}")
            if not 0 < self.moe_router_topk <= self.num_experts:
                raise ValueError(f"moe_router_topk must be in 1..{self.num_experts}, got {self.moe_router_topk}")
            if self.router_aux_loss_coef < 0:
                raise ValueError(f"router_aux_loss_coef must be >= 0, got {self.router_aux_loss_coef}")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    def check_layout(self, tp: int, pp: int, ep: int = 1, etp: int | None = None) -> None:
        """ValueError unless this model splits evenly over ``tp`` x ``pp`` ranks, its experts over
        ``ep`` expert-parallel ranks each split ``etp``-way (megatron-core's expert tensor
        parallelism; ``None``: ``tp``, megatron-core's default)."""
        etp = tp if etp is None else etp
        if tp < 1 or pp < 1 or ep < 1 or etp < 1:
            raise ValueError(f"tp, pp, ep and etp must be >= 1, got tp={tp} pp={pp} ep={ep} etp={etp}")
        for what, n in (("attention heads", self.num_attention_heads),
                        ("key/value heads", self.num_query_groups),
                        ("vocab size", self.vocab_size),
                        *((("ffn hidden size", self.ffn_hidden_size),) if not self.is_moe else ())):
            if n % tp:
                raise ValueError(f"tp={tp} does not divide the {what} ({n})")
        if self.num_layers % pp:
            raise ValueError(f"pp={pp} does not divide the number of layers ({self.num_layers})")
        if not self.is_moe:
            if ep != 1 or etp != tp:
                raise ValueError(f"ep={ep} / etp={etp}: expert parallelism needs an MoE model ({self.family} is dense)")
            return
        if self.num_experts % ep:
            raise ValueError(f"ep={ep} does not divide the number of experts ({self.num_experts})")
        if self.moe_ffn_hidden_size % etp:
            raise ValueError(f"etp={etp} does not divide the expert ffn hidden size ({self.moe_ffn_hidden_size})")

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
                raise ValueError(f"{model_type} with use_sliding_window=true is not supported")
            qkv_bias = family == "qwen2"
            if family != "qwen2" and cfg.get("attention_bias"):
                raise ValueError(f"{model_type} with attention_bias=true is not supported")
        moe = _moe_fields(cfg, model_type) if family in MOE_FAMILIES else {}
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
            qk_layernorm=family in QK_NORM_FAMILIES,
            **moe,
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelSpec:
        return cls(**d)

    def transformer_config(self, *, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None,
                           **overrides: Any):
        """megatron-core ``TransformerConfig`` for this model at tensor/pipeline sizes ``tp``/``pp``
        (and, for MoE, expert-parallel ``ep`` / expert-tensor-parallel ``etp``)."""
        import torch.nn.functional as F
        from megatron.core.transformer import TransformerConfig

        self.check_layout(tp, pp, ep, etp)
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
            qk_layernorm=self.qk_layernorm,
        )
        if self.is_moe:
            from megatron_tir.policy.moe import moe_config_kwargs

            kwargs.update(moe_config_kwargs(self, ep=ep, etp=tp if etp is None else etp, on_gpu=on_gpu))
        kwargs.update(overrides)
        return TransformerConfig(**kwargs)


def _moe_fields(cfg: dict, model_type: str) -> dict:
    """The MoE fields of ``ModelSpec`` from a Qwen3-MoE config; ValueError for layouts Megatron's
    uniform MoE stack would not reproduce (dense layers between the MoE layers)."""
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        raise ValueError(f"{model_type} with dense layers (mlp_only_layers={cfg.get('mlp_only_layers')}, "
                         f"decoder_sparse_step={cfg.get('decoder_sparse_step')}) is not supported: "
                         f"every layer must be an MoE layer")
    if cfg.get("shared_expert_intermediate_size"):
        raise ValueError(f"{model_type} with shared experts is not supported")
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    return dict(num_experts=int(experts), moe_ffn_hidden_size=int(cfg.get("moe_intermediate_size") or 0),
                moe_router_topk=int(cfg.get("num_experts_per_tok") or 0),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                router_aux_loss_coef=float(cfg.get("router_aux_loss_coef") or 0.0))


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
                         f"(supported: {', '.join(FAMILIES)})")
    return raw


def spec_from_hf_dir(hf_dir: Path) -> tuple[ModelSpec, dict]:
    config = read_hf_config(hf_dir)
    return ModelSpec.from_hf(config), config

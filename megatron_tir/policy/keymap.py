"""HF <-> Megatron key maps, one explicit table per family, and their tensor transforms.

Megatron names (``KeyRule.megatron``) are megatron-core GPTModel state-dict names of the
local layer spec with the global layer index ``{i}``. What megatron-core itself keys the
model by is the sharded state dict (``TensorPlan.sharded``): the same for both layer specs,
because the local spec maps its norms onto the Transformer Engine spec's fused names with
its ``sharded_state_dict_keys_map`` (``LOCAL_SPEC_KEYS_MAP``), e.g.
``decoder.layers.{i}.input_layernorm.weight`` ->
``decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight``; in a checkpoint the
layers are stacked on a leading axis (``sharded_key``). The TE spec's state-dict names are
the sharded names (TE's ``LayerNormLinear`` holds the fused norm as ``layer_norm_weight``),
or, with TE's op fuser, the names of ``TE_SPEC_KEYS_MAP``. ``local_name`` turns a state-dict
name of either spec into the local name the tables use; TE's ``_extra_state`` entries
carry no weights and are not part of the map. So a checkpoint written here loads into the
TE spec and the local spec, at any TP/PP, and either spec's model exports through it.

Transforms (all are pure re-arrangements: the round trip is bit-exact):

* ``identity``: same tensor.
* ``qkv``: HF q ``[nh*d, ...]``, k ``[ng*d, ...]``, v ``[ng*d, ...]`` -> Megatron's fused
  ``linear_qkv`` interleaved by query group: for each of the ``ng`` groups, its
  ``nh/ng`` query heads, then its key head, then its value head (``[ng*(nh/ng+2)*d, ...]``).
  Tensor parallelism splits this tensor by whole groups, which is why TP must divide
  the number of key/value heads. Applies to the weight and (Qwen2) the bias.
* ``gate_up``: HF gate ``[f, h]`` and up ``[f, h]`` -> ``linear_fc1`` ``[2f, h]`` = cat(gate, up).
  (megatron-core shards the two halves separately, so the layout on disk is TP-agnostic.)

MoE (Qwen3-MoE): each expert's tensors are rows of their own (``{e}``: the global expert
index), HF's per-expert file names (``mlp.experts.{e}.gate_proj.weight`` ...; transformers 5
fuses them in memory but reads and writes these names) <-> megatron-core's ``SequentialMLP``
names (``mlp.experts.local_experts.{e}.linear_fc1.weight``); the grouped-GEMM experts
(``TEGroupedMLP``) name the same tensors ``mlp.experts.linear_fc1.weight{e}`` (``local_name``
maps them). Both store them under one sharded key per kind,
``decoder.layers.mlp.experts.experts.linear_fc1.weight``, stacked on (layer, expert)
(``stored_key``); a stage's state dict holds its local experts (index from 0 on each
expert-parallel rank: ``expert_offset``). An MoE layer's ``pre_mlp_layernorm`` keeps its name
in both specs (``moe_local_spec_keys_map``).

Rotary embeddings need no permutation: HF Llama/Qwen2 store q/k for the non-interleaved
``rotate_half`` convention, which is megatron-core's ``rotary_interleaved=False``.
"""

from __future__ import annotations

from dataclasses import dataclass

import re

import torch

from megatron_tir.policy.spec import ModelSpec

TRANSFORMS = ("identity", "qkv", "gate_up")

# megatron-core's own layer-relative prefix maps (``TransformerLayerSubmodules.sharded_state_dict_keys_map``):
# the local spec's (megatron/core/models/gpt/gpt_layer_specs.py, ``get_gpt_layer_local_spec``) ...
LOCAL_SPEC_KEYS_MAP = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                       "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
# ... and the TE spec's (``get_gpt_layer_with_transformer_engine_spec``: names of TE's op-fuser MLP)
TE_SPEC_KEYS_MAP = {"mlp.0.weight": "mlp.linear_fc1.layer_norm_weight",
                    "mlp.0.bias": "mlp.linear_fc1.layer_norm_bias",
                    "mlp.1.basic_ops.0.weight": "mlp.linear_fc1.weight",
                    "mlp.1.basic_ops.1.bias": "mlp.linear_fc1.bias",
                    "mlp.3.basic_ops.0.weight": "mlp.linear_fc2.weight",
                    "mlp.3.basic_ops.1.bias": "mlp.linear_fc2.bias"}
EXTRA_STATE = "_extra_state"  # TE modules' non-weight state (FP8 metadata): not in the key map
_LAYERS = "decoder.layers."


def moe_local_spec_keys_map(local_map: dict[str, str]) -> dict[str, str]:
    """The local spec's prefix map for an MoE layer: the MoE layer's ``pre_mlp_layernorm`` is its
    own module in the TE spec too (no fused ``linear_fc1`` to hold it), so it keeps its name."""
    return {k: v for k, v in local_map.items() if k != "pre_mlp_layernorm."}


_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")
_SEQUENTIAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$")


def _map_prefix(rest: str, mapping: dict[str, str]) -> str:
    for old, new in mapping.items():  # as megatron-core's apply_prefix_mapping: the first prefix that matches
        if rest.startswith(old):
            return new + rest[len(old):]
    return rest


def _split_layer(name: str) -> tuple[str, str] | None:
    if not name.startswith(_LAYERS):
        return None
    i, rest = name[len(_LAYERS):].split(".", 1)
    return i, rest


def sharded_name(name: str, *, moe: bool = False) -> str:
    """A local-spec (or TE) state-dict name (global layer and expert index) -> its sharded-state-dict
    name (megatron-core's key with the layer index kept in place: the TE spec's state-dict name; an
    expert's: the grouped-GEMM name ``mlp.experts.linear_fc1.weight{e}``). ``moe``: an MoE model's
    layer (its ``pre_mlp_layernorm`` keeps its name)."""
    parts = _split_layer(name)
    if parts is None:
        return name
    expert = _SEQUENTIAL_EXPERT.match(parts[1])
    if expert:
        return f"{_LAYERS}{parts[0]}.mlp.experts.{expert[2]}.{expert[3]}{expert[1]}"
    local_map = moe_local_spec_keys_map(LOCAL_SPEC_KEYS_MAP) if moe else LOCAL_SPEC_KEYS_MAP
    return f"{_LAYERS}{parts[0]}.{_map_prefix(_map_prefix(parts[1], TE_SPEC_KEYS_MAP), local_map)}"


_TO_LOCAL = {new: old for old, new in LOCAL_SPEC_KEYS_MAP.items()}


def local_name(name: str) -> str:
    """A state-dict name of the local spec, the TE spec (with or without its op fuser; grouped-GEMM
    experts) or a sharded name with its layer index -> the local spec's name (``KeyRule.megatron``)."""
    parts = _split_layer(name)
    if parts is None:
        return name
    grouped = _GROUPED_EXPERT.match(parts[1])
    if grouped:
        return f"{_LAYERS}{parts[0]}.mlp.experts.local_experts.{grouped[3]}.{grouped[1]}.{grouped[2]}"
    return f"{_LAYERS}{parts[0]}.{_map_prefix(_map_prefix(parts[1], TE_SPEC_KEYS_MAP), _TO_LOCAL)}"


def stored_key(name: str, *, moe: bool = False) -> tuple[str, tuple[int, ...]]:
    """A state-dict name of either spec (global indices) -> (megatron-core's sharded key, leading
    indices): in a checkpoint a layer's tensor is the slice ``[layer]`` of the stacked tensor
    ``key``, an expert's the slice ``[layer, expert]``; () for the embedding, final norm and head."""
    local = local_name(name)
    parts = _split_layer(local)
    if parts is None:
        return local, ()
    expert = _SEQUENTIAL_EXPERT.match(parts[1])
    if expert:
        return f"{_LAYERS}mlp.experts.experts.{expert[2]}.{expert[3]}", (int(parts[0]), int(expert[1]))
    full = _split_layer(sharded_name(local, moe=moe))
    return f"{_LAYERS}{full[1]}", (int(full[0]),)


def sharded_key(name: str, *, moe: bool = False) -> tuple[str, int | None]:
    """A state-dict name of either spec, not an expert's -> (megatron-core's sharded key, layer
    index or None): ``stored_key`` with its one leading index."""
    key, lead = stored_key(name, moe=moe)
    if len(lead) > 1:
        raise ValueError(f"{name} is an expert's tensor: use stored_key (layer and expert index)")
    return key, (lead[0] if lead else None)


def expert_offset(name: str, offset: int) -> str:
    """A local-spec name with a stage's local expert index -> the same with ``offset`` added (the
    global index); other names unchanged."""
    parts = _split_layer(name)
    expert = _SEQUENTIAL_EXPERT.match(parts[1]) if parts else None
    if not expert:
        return name
    return f"{_LAYERS}{parts[0]}.mlp.experts.local_experts.{int(expert[1]) + offset}.{expert[2]}.{expert[3]}"


def is_extra_state(name: str) -> bool:
    return name.rsplit(".", 1)[-1] == EXTRA_STATE


@dataclass(kw_only=True, slots=True, frozen=True)
class KeyRule:
    """One row of a key map: HF tensor name(s) <-> one Megatron tensor, via ``transform``."""

    hf: tuple[str, ...]
    megatron: str
    transform: str = "identity"
    per_layer: bool = False
    per_expert: bool = False
    untied_only: bool = False

    def __post_init__(self) -> None:
        if self.transform not in TRANSFORMS:
            raise ValueError(f"unknown transform {self.transform!r}")
        if (len(self.hf) == 1) != (self.transform == "identity"):
            raise ValueError(f"transform {self.transform!r} does not fit {len(self.hf)} HF tensors")
        if self.per_layer != ("{i}" in self.megatron):
            raise ValueError(f"per_layer rule must use {{i}} in names: {self.megatron}")
        if self.per_expert != ("{e}" in self.megatron) or (self.per_expert and not self.per_layer):
            raise ValueError(f"per_expert rule must be per layer and use {{e}} in names: {self.megatron}")


def _layer(hf: tuple[str, ...], megatron: str, transform: str = "identity") -> KeyRule:
    return KeyRule(hf=tuple(f"model.layers.{{i}}.{h}" for h in hf), megatron=f"decoder.layers.{{i}}.{megatron}",
                   transform=transform, per_layer=True)


def _expert(hf: tuple[str, ...], megatron: str, transform: str = "identity") -> KeyRule:
    return KeyRule(hf=tuple(f"model.layers.{{i}}.mlp.experts.{{e}}.{h}" for h in hf),
                   megatron=f"decoder.layers.{{i}}.mlp.experts.local_experts.{{e}}.{megatron}",
                   transform=transform, per_layer=True, per_expert=True)


_LLAMA_RULES: tuple[KeyRule, ...] = (
    KeyRule(hf=("model.embed_tokens.weight",), megatron="embedding.word_embeddings.weight"),
    _layer(("input_layernorm.weight",), "input_layernorm.weight"),
    _layer(("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
           "self_attention.linear_qkv.weight", "qkv"),
    _layer(("self_attn.o_proj.weight",), "self_attention.linear_proj.weight"),
    _layer(("post_attention_layernorm.weight",), "pre_mlp_layernorm.weight"),
    _layer(("mlp.gate_proj.weight", "mlp.up_proj.weight"), "mlp.linear_fc1.weight", "gate_up"),
    _layer(("mlp.down_proj.weight",), "mlp.linear_fc2.weight"),
    KeyRule(hf=("model.norm.weight",), megatron="decoder.final_layernorm.weight"),
    KeyRule(hf=("lm_head.weight",), megatron="output_layer.weight", untied_only=True),
)

_QWEN2_RULES: tuple[KeyRule, ...] = (
    *_LLAMA_RULES[:3],
    _layer(("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
           "self_attention.linear_qkv.bias", "qkv"),
    *_LLAMA_RULES[3:],
)

# Qwen3: no qkv bias; per-head RMSNorm of queries and keys (HF q_norm / k_norm, megatron-core's
# q_layernorm / k_layernorm, the same in the TE spec: TENorm modules of those names)
_QK_NORM_RULES: tuple[KeyRule, ...] = (
    _layer(("self_attn.q_norm.weight",), "self_attention.q_layernorm.weight"),
    _layer(("self_attn.k_norm.weight",), "self_attention.k_layernorm.weight"),
)
_QWEN3_RULES: tuple[KeyRule, ...] = (*_LLAMA_RULES[:3], *_QK_NORM_RULES, *_LLAMA_RULES[3:])

# Qwen3-MoE: Qwen3's attention; the MLP is a router (HF ``mlp.gate``) and per-expert SwiGLU MLPs
_QWEN3_MOE_RULES: tuple[KeyRule, ...] = (
    *_QWEN3_RULES[:6],  # embedding, input norm, qkv, q/k norms, o_proj
    _layer(("post_attention_layernorm.weight",), "pre_mlp_layernorm.weight"),
    _layer(("mlp.gate.weight",), "mlp.router.weight"),
    _expert(("gate_proj.weight", "up_proj.weight"), "linear_fc1.weight", "gate_up"),
    _expert(("down_proj.weight",), "linear_fc2.weight"),
    *_LLAMA_RULES[-2:],  # final norm, lm_head
)

KEY_MAPS: dict[str, tuple[KeyRule, ...]] = {"llama": _LLAMA_RULES, "qwen2": _QWEN2_RULES, "qwen3": _QWEN3_RULES,
                                            "qwen3_moe": _QWEN3_MOE_RULES}


@dataclass(kw_only=True, slots=True, frozen=True)
class TensorPlan:
    """One concrete Megatron tensor and the HF tensors it is made of, with expected shapes."""

    megatron: str
    hf: tuple[str, ...]
    transform: str
    hf_shapes: tuple[tuple[int, ...], ...]
    megatron_shape: tuple[int, ...]
    moe: bool = False  # a tensor of an MoE model

    @property
    def sharded(self) -> str:
        """The sharded-state-dict name (layer index in place) = the TE spec's state-dict name."""
        return sharded_name(self.megatron, moe=self.moe)

    @property
    def stored(self) -> tuple[str, tuple[int, ...]]:
        """(megatron-core's sharded key, leading indices): where a checkpoint stores this tensor."""
        return stored_key(self.megatron, moe=self.moe)


def _hf_shapes(rule: KeyRule, spec: ModelSpec) -> tuple[tuple[int, ...], ...]:
    h, d, f, v = spec.hidden_size, spec.head_dim, spec.ffn_hidden_size, spec.vocab_size
    q, kv = spec.num_attention_heads * d, spec.num_query_groups * d
    if rule.per_expert:
        f = spec.moe_ffn_hidden_size
    leaf = rule.megatron.rsplit(".", 2)[-2:]
    match ".".join(leaf):
        case "router.weight":
            return ((spec.num_experts, h),)
        case "word_embeddings.weight" | "output_layer.weight":
            return ((v, h),)
        case "linear_qkv.weight":
            return ((q, h), (kv, h), (kv, h))
        case "linear_qkv.bias":
            return ((q,), (kv,), (kv,))
        case "linear_proj.weight":
            return ((h, q),)
        case "linear_fc1.weight":
            return ((f, h), (f, h))
        case "linear_fc2.weight":
            return ((h, f),)
        case "q_layernorm.weight" | "k_layernorm.weight":
            return ((d,),)
        case _:  # norms
            return ((h,),)


def plan(spec: ModelSpec) -> list[TensorPlan]:
    """Every Megatron tensor of ``spec`` in checkpoint order (embedding, layers 0..L-1, head)."""
    out: list[TensorPlan] = []
    rules = KEY_MAPS[spec.family]
    for rule in rules:
        if rule.untied_only and spec.tie_word_embeddings:
            continue
        layers = range(spec.num_layers) if rule.per_layer else [None]
        experts = range(spec.num_experts) if rule.per_expert else [None]
        shapes = _hf_shapes(rule, spec)
        mshape = (sum(s[0] for s in shapes), *shapes[0][1:])
        for i in layers:
            for e in experts:
                def fmt(s: str, i=i, e=e) -> str:
                    return s.format(i=i, e=e) if i is not None else s
                out.append(TensorPlan(megatron=fmt(rule.megatron), hf=tuple(fmt(n) for n in rule.hf),
                                      transform=rule.transform, hf_shapes=shapes, megatron_shape=mshape,
                                      moe=spec.is_moe))
    # order by layer so that conversion streams one layer at a time
    return sorted(out, key=_order_key)


def _order_key(p: TensorPlan):
    if p.megatron.startswith("embedding."):
        return (0, 0)
    if p.megatron.startswith("decoder.layers."):
        return (1, int(p.megatron.split(".")[2]))
    return (2, 0)


def to_megatron(p: TensorPlan, tensors: list[torch.Tensor], spec: ModelSpec) -> torch.Tensor:
    """HF tensors (in ``p.hf`` order) -> the Megatron tensor."""
    if p.transform == "identity":
        return tensors[0]
    if p.transform == "gate_up":
        return torch.cat(tensors, dim=0)
    q, k, v = tensors
    ng, d, hpg = spec.num_query_groups, spec.head_dim, spec.heads_per_group
    rest = q.shape[1:]
    fused = torch.cat([q.reshape(ng, hpg * d, *rest), k.reshape(ng, d, *rest), v.reshape(ng, d, *rest)], dim=1)
    return fused.reshape(ng * (hpg + 2) * d, *rest)


def to_hf(p: TensorPlan, tensor: torch.Tensor, spec: ModelSpec) -> list[torch.Tensor]:
    """The Megatron tensor -> HF tensors (in ``p.hf`` order), each contiguous."""
    if p.transform == "identity":
        return [tensor.contiguous()]
    if p.transform == "gate_up":
        return [t.contiguous() for t in torch.chunk(tensor, 2, dim=0)]
    ng, d, hpg = spec.num_query_groups, spec.head_dim, spec.heads_per_group
    rest = tensor.shape[1:]
    grouped = tensor.reshape(ng, (hpg + 2) * d, *rest)
    q, k, v = torch.split(grouped, [hpg * d, d, d], dim=1)
    return [q.reshape(ng * hpg * d, *rest).contiguous(), k.reshape(ng * d, *rest).contiguous(),
            v.reshape(ng * d, *rest).contiguous()]


def hf_row_spans(p: TensorPlan, spec: ModelSpec) -> list[list[tuple[int, int]]]:
    """For each HF tensor of ``p`` (in ``p.hf`` order), the ``(first row, rows)`` blocks of the
    Megatron tensor's leading dimension that make it, in order: ``to_hf`` as row ranges, so a
    contiguous stored tensor can be split by copying bytes."""
    if p.transform == "identity":
        return [[(0, p.megatron_shape[0])]]
    if p.transform == "gate_up":
        f = p.hf_shapes[0][0]
        return [[(0, f)], [(f, f)]]
    ng, d, hpg = spec.num_query_groups, spec.head_dim, spec.heads_per_group
    group = (hpg + 2) * d
    return [[(g * group, hpg * d) for g in range(ng)],
            [(g * group + hpg * d, d) for g in range(ng)],
            [(g * group + (hpg + 1) * d, d) for g in range(ng)]]


def table(family: str) -> str:
    """The key map of ``family`` as a markdown table."""
    if family not in KEY_MAPS:
        raise ValueError(f"unknown family {family!r} (known: {sorted(KEY_MAPS)})")
    rows = ["| HF tensor(s) | Megatron (GPTModel state dict) | transform |", "| --- | --- | --- |"]
    for r in KEY_MAPS[family]:
        hf = "<br>".join(f"`{n}`" for n in r.hf)
        note = " (untied only)" if r.untied_only else (" (each expert `{e}`)" if r.per_expert else "")
        rows.append(f"| {hf} | `{r.megatron}`{note} | {r.transform} |")
    return "\n".join(rows)

"""How the policy model is built: this rank's part of the megatron-core GPTModel.

``build_gpt_model(spec, ...)`` builds this rank's GPTModel stage (after
``megatron_tir.policy.parallel.init_parallel``) with the Transformer Engine layer spec when
TE is importable on a GPU, megatron-core's local spec otherwise.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from megatron_tir.policy.spec import ModelSpec

log = logging.getLogger(__name__)


def te_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def layer_spec(spec: ModelSpec, *, use_te: bool | None = None):
    """The transformer layer spec: Transformer Engine on a GPU with TE; megatron-core's local spec
    otherwise, with its core attention computed by fused SDPA (``attention``). Qwen3 adds the
    query/key RMSNorm (``qk_layernorm``); an MoE model gets megatron-core's MoE layer (grouped-GEMM
    experts with TE, ``SequentialMLP`` otherwise), whose separate ``pre_mlp_layernorm`` keeps its
    own name in the local spec's checkpoints too (``keymap.moe_local_spec_keys_map``)."""
    from megatron.core.models.gpt import gpt_layer_specs

    if use_te is None:
        use_te = te_available()
    experts = spec.num_experts or None
    if use_te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=spec.is_moe, qk_layernorm=spec.qk_layernorm)
    from megatron_tir.policy.attention import SdpaDotProductAttention
    from megatron_tir.policy.keymap import moe_local_spec_keys_map

    local = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=experts, qk_layernorm=spec.qk_layernorm,
                                                     normalization="RMSNorm")
    local.submodules.self_attention.submodules.core_attention = SdpaDotProductAttention
    if spec.is_moe:
        local.submodules.sharded_state_dict_keys_map = moe_local_spec_keys_map(
            local.submodules.sharded_state_dict_keys_map)
    return local


def build_gpt_model(spec: ModelSpec, *, pre_process: bool | None = None, post_process: bool | None = None,
                    parallel_output: bool = True, meta: bool = False, use_te: bool | None = None,
                    value_head: bool = False, **config_overrides):
    """This rank's GPTModel for ``spec`` at the current TP/PP (``init_parallel`` first).

    ``meta=True`` builds it on the meta device (no memory, no init): enough for
    ``sharded_state_dict()`` key/shape templates, as checkpoint conversion uses it.
    ``value_head=True`` builds a critic: untied embeddings and a one-output value head on the
    last stage (``megatron_tir.policy.value_head``).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if spec.is_moe:
        config_overrides.setdefault("ep", parallel_state.get_expert_model_parallel_world_size())
        config_overrides.setdefault("etp", parallel_state.get_expert_tensor_parallel_world_size())
        config_overrides.setdefault("moe_grouped_gemm", te_available() if use_te is None else use_te)
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    if meta:
        config_overrides.setdefault("perform_initialization", False)
    config = spec.transformer_config(tp=tp, pp=pp, **config_overrides)
    ctx = torch.device("meta") if meta else contextlib.nullcontext()
    with ctx:
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec(spec, use_te=use_te),
            vocab_size=spec.vocab_size,
            max_sequence_length=spec.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            parallel_output=parallel_output,
            share_embeddings_and_output_weights=spec.tie_word_embeddings and not value_head,
            position_embedding_type="rope",
            rotary_percent=1.0,
            rotary_base=spec.rotary_base,
        )
        if value_head:
            from megatron_tir.policy.value_head import attach_value_head

            attach_value_head(model)
    if not meta and torch.cuda.is_available():
        model.cuda()
    return model

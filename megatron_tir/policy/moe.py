"""How a Qwen3-MoE model maps onto megatron-core's MoE layer.

Qwen3-MoE's router (transformers ``Qwen3MoeTopKRouter``) takes the softmax over all experts'
logits, keeps the top k, and with ``norm_topk_prob`` divides them by their sum. megatron-core's
``TopKRouter`` with ``moe_router_score_function="softmax"`` computes the same two ways:
``moe_router_pre_softmax=True`` is softmax-then-top-k (the unnormalised probabilities),
``False`` is top-k-then-softmax over the k chosen logits, which equals the renormalised
probabilities (``softmax(x)_i / sum_topk softmax(x)_j = exp(x_i) / sum_topk exp(x_j)``). So
``norm_topk_prob`` is ``not moe_router_pre_softmax``.

The experts are megatron-core's ``SequentialMLP`` (one MLP per local expert) on CPU and its
``TEGroupedMLP`` (one grouped GEMM over all local experts) with Transformer Engine; the token
dispatcher is all-to-all, except on CPU without expert parallelism, where the all-gather one
does the same with less (the all-to-all one runs on CPU through ``cpu_compat``'s stream
stand-in; with ``ep > 1`` it is needed: the all-gather dispatcher gathers equal-sized token
blocks, but data-parallel replicas hold micro-batches of different lengths). Load-balancing and z-loss coefficients are training settings
(``MoESettings``); the model's own ``router_aux_loss_coef`` is the default of the former.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron_tir.policy.spec import ModelSpec

ROUTING_REPLAY_MODES = ("none", "old_pass", "rollout")  # trainer.ppo.routing_replay (policy.routing.UpdateRouting)


@dataclass(kw_only=True, slots=True, frozen=True)
class MoESettings:
    """Training settings of an MoE policy.

    ``aux_loss_coeff``: the load-balancing loss coefficient (None: the model's
    ``router_aux_loss_coef``); ``z_loss_coeff``: the router z-loss (0: off); ``router_dtype``:
    the dtype the router's softmax/top-k runs in (``fp32`` keeps bf16 models' routing stable);
    ``grouped_gemm``: the grouped-GEMM experts (needs Transformer Engine; None: the layer spec
    decides, i.e. when TE is there: ``build.layer_spec``).
    """

    aux_loss_coeff: float | None = None
    z_loss_coeff: float = 0.0
    router_dtype: str | None = "fp32"
    grouped_gemm: bool | None = None

    def __post_init__(self) -> None:
        if self.aux_loss_coeff is not None and self.aux_loss_coeff < 0:
            raise ValueError(f"aux_loss_coeff must be >= 0, got {self.aux_loss_coeff}")
        if self.z_loss_coeff < 0:
            raise ValueError(f"z_loss_coeff must be >= 0, got {self.z_loss_coeff}")
        if self.router_dtype not in (None, "fp32", "fp64"):
            raise ValueError(f"router_dtype must be None, 'fp32' or 'fp64', got {self.router_dtype!r}")


def moe_config_kwargs(spec: ModelSpec, *, ep: int, etp: int, on_gpu: bool,
                      settings: MoESettings | None = None) -> dict[str, Any]:
    """megatron-core ``TransformerConfig`` fields of ``spec``'s MoE layer at expert-parallel size
    ``ep`` and expert-tensor-parallel size ``etp``."""
    settings = settings or MoESettings()
    aux = spec.router_aux_loss_coef if settings.aux_loss_coeff is None else settings.aux_loss_coeff
    return dict(
        num_moe_experts=spec.num_experts,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_router_topk=spec.moe_router_topk,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not spec.norm_topk_prob,
        moe_router_load_balancing_type="aux_loss" if aux > 0 else "none",
        moe_aux_loss_coeff=aux,
        moe_z_loss_coeff=settings.z_loss_coeff or None,
        moe_router_dtype=settings.router_dtype,
        moe_token_dispatcher_type="alltoall" if on_gpu or ep > 1 else "allgather",
        moe_grouped_gemm=bool(settings.grouped_gemm),
        moe_permute_fusion=False,
        moe_router_fusion=False,
        moe_expert_capacity_factor=None,  # dropless, as transformers' Qwen3-MoE: every token reaches its top-k
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )

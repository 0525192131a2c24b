"""The learner's config: model, layout, precision, optimizer and lr schedule, micro-batching.

What a step takes and returns (``TrainBatch``, ``LossFn``, ``StepResult``) is in
``megatron_tir.policy.learner_contract``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass



DTYPES = ("float32", "bfloat16")
FP8_FORMATS = ("e4m3", "hybrid")  # TransformerConfig.fp8
FP8_RECIPES = ("tensorwise", "delayed", "mxfp8", "blockwise")  # TransformerConfig.fp8_recipe
FP8_AMAX_ALGOS = ("most_recent", "max")  # TransformerConfig.fp8_amax_compute_algo
RECOMPUTE_GRANULARITIES = ("selective", "full")  # TransformerConfig.recompute_granularity
RECOMPUTE_METHODS = ("uniform", "block")  # TransformerConfig.recompute_method
FP8_TOKEN_MULTIPLE = 16  # Transformer Engine's FP8 GEMMs want token counts divisible by 16
# Transformer Engine's FP8 check (transformer_engine/pytorch/utils.py assert_dim_for_fp8_exec, called on each
# Linear / LayerNormLinear / LayerNormMLP input) wants the product of an input's leading dims divisible by 8. Under
# sequence parallelism a column-parallel layer sees the local shard [L/tp, rows, h] before its all-gather, so
# L/tp must be a multiple of 8 whatever the row count: L a multiple of 8 x TP.
FP8_LOCAL_SHARD_MULTIPLE = 8
LR_DECAY_STYLES = ("constant", "linear", "cosine")
HEADS = ("lm", "value")  # the policy's vocab-parallel LM head | a critic's one-output value head



@dataclass(kw_only=True, slots=True)
class LearnerConfig:
    """What the policy learner is: model, layout, precision, optimizer and lr schedule, micro-batching.

    ``model``: ``"smollm2"``, ``"tiny-qwen2"``, an HF directory, or a checkpoint / run
    directory written by the trainer or ``tir-ckpt`` (then its weights are loaded; the
    optimizer state is restored by ``megatron_tir.policy.checkpoint.learner_io.load_learner``). The lr warms up linearly from 0 over
    ``warmup_steps`` optimizer steps (step k uses ``lr * k / warmup_steps``), then follows
    ``lr_decay_style`` down to ``min_lr`` at ``lr_decay_steps`` ("constant": stays at ``lr``).

    Memory: ``sequence_parallel`` and the ``recompute_*`` keys are megatron-core's
    ``TransformerConfig`` settings of the same names (sequence parallelism needs TP > 1 and
    Transformer Engine's norms; ``recompute_granularity="full"`` needs ``recompute_method`` and
    ``recompute_num_layers``; "selective" recomputes core attention). FP8 (Transformer Engine):
    ``fp8`` is the format, ``fp8_recipe`` / ``fp8_amax_history_len`` / ``fp8_amax_compute_algo``
    megatron-core's names. Micro-batch lengths are padded to a multiple of
    :attr:`pad_multiple`: TP under sequence parallelism, 16 under FP8, 8 x TP under both (Transformer Engine
    checks the sequence-parallel local shard), and ``pad_to_multiple``.
    """

    model: str = "smollm2"  # the policy's weights
    head: str = "lm"  # "lm" (the policy) | "value" (a critic: megatron_tir.policy.value_head)
    tp: int = 1  # tensor-parallel size (must divide the attention heads)
    pp: int = 1  # pipeline-parallel stages (must divide the layers)
    ep: int = 1  # expert-parallel size (MoE: experts split over this many of a stage's tp x dp ranks)
    moe_aux_loss_coeff: float | None = None  # MoE load-balancing loss coefficient (None: the model's)
    moe_z_loss_coeff: float = 0.0  # MoE router z-loss coefficient (0: off)
    dtype: str = "float32"  # parameter and compute dtype: float32 | bfloat16
    lr: float = 1e-6  # peak learning rate (AdamW)
    min_lr: float = 0.0  # the lr at lr_decay_steps (linear / cosine decay)
    warmup_steps: int = 0  # optimizer steps of linear warm-up from 0 to lr
    lr_decay_style: str = "constant"  # constant | linear | cosine (after the warm-up)
    lr_decay_steps: int | None = None  # optimizer steps to reach min_lr; None: no decay
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    adam_beta1: float = 0.9  # AdamW beta1
    adam_beta2: float = 0.999  # AdamW beta2
    adam_eps: float = 1e-8  # AdamW epsilon
    grad_clip: float = 1.0  # global gradient-norm clip (0: off)
    distributed_optimizer: bool = False  # shard optimizer state over data-parallel ranks (megatron-core)
    max_tokens_per_microbatch: int = 4096  # rows are packed into micro-batches of at most this many tokens
    sequence_parallel: bool = False  # megatron-core sequence parallelism (needs TP > 1 and Transformer Engine)
    recompute_granularity: str | None = None  # None | "selective" | "full"
    recompute_method: str | None = None  # "uniform" | "block" (full recomputation)
    recompute_num_layers: int | None = None  # layers per unit (uniform) / recomputed layers per stage (block)
    fp8: str | None = None  # None | "e4m3" | "hybrid"
    fp8_recipe: str = "delayed"  # tensorwise | delayed | mxfp8 | blockwise (with fp8)
    fp8_amax_history_len: int = 1024  # amax history of the delayed FP8 recipe
    fp8_amax_compute_algo: str = "max"  # max | most_recent (delayed FP8 recipe)
    pad_to_multiple: int = 1  # micro-batch lengths are padded to a multiple of this (and of pad_multiple's terms)
    seed: int = 1234  # model-parallel RNG seed of the learner (init, dropout)

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("learner.model must name a model ('smollm2', 'tiny-qwen2', an HF or checkpoint dir)")
        if self.head not in HEADS:
            raise ValueError(f"learner.head {self.head!r} is not one of {', '.join(HEADS)}")
        if self.tp < 1 or self.pp < 1:
            raise ValueError(f"learner.tp and learner.pp must be >= 1, got tp={self.tp} pp={self.pp}")
        if self.ep < 1:
            raise ValueError(f"learner.ep must be >= 1, got {self.ep}")
        if (self.moe_aux_loss_coeff is not None and self.moe_aux_loss_coeff < 0) or self.moe_z_loss_coeff < 0:
            raise ValueError("learner.moe_aux_loss_coeff and learner.moe_z_loss_coeff must be >= 0")
        if self.dtype not in DTYPES:
            raise ValueError(f"learner.dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.fp8 is not None and self.fp8 not in FP8_FORMATS:
            raise ValueError(f"learner.fp8 {self.fp8!r} is not one of {', '.join(FP8_FORMATS)} (or null)")
        if self.fp8_recipe not in FP8_RECIPES:
            raise ValueError(f"learner.fp8_recipe {self.fp8_recipe!r} is not one of {', '.join(FP8_RECIPES)}")
        if self.fp8_amax_compute_algo not in FP8_AMAX_ALGOS:
            raise ValueError(f"learner.fp8_amax_compute_algo {self.fp8_amax_compute_algo!r} is not one of "
                             f"{', '.join(FP8_AMAX_ALGOS)}")
        if self.fp8_amax_history_len < 1:
            raise ValueError(f"learner.fp8_amax_history_len must be >= 1, got {self.fp8_amax_history_len}")
        if self.sequence_parallel and self.tp < 2:  # megatron-core's ModelParallelConfig refuses it too
            raise ValueError("learner.sequence_parallel needs learner.tp > 1")
        self._check_recompute()
        if self.pad_to_multiple < 1:
            raise ValueError(f"learner.pad_to_multiple must be >= 1, got {self.pad_to_multiple}")
        if not self.lr > 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"need lr > 0 and 0 <= min_lr <= lr, got lr={self.lr} min_lr={self.min_lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"learner.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(f"learner.lr_decay_style {self.lr_decay_style!r} is not one of "
                             f"{', '.join(LR_DECAY_STYLES)}")
        if self.lr_decay_style != "constant" and (self.lr_decay_steps is None
                                                  or self.lr_decay_steps <= self.warmup_steps):
            raise ValueError(f"learner.lr_decay_style={self.lr_decay_style} needs lr_decay_steps > warmup_steps")
        if self.weight_decay < 0:
            raise ValueError(f"learner.weight_decay must be >= 0, got {self.weight_decay}")
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1) or self.adam_eps <= 0:
            raise ValueError("learner.adam_beta1/adam_beta2 must be in [0, 1) and adam_eps > 0")
        if self.grad_clip < 0:
            raise ValueError(f"learner.grad_clip must be >= 0 (0: no clipping), got {self.grad_clip}")
        if self.max_tokens_per_microbatch < 1:
            raise ValueError(f"learner.max_tokens_per_microbatch must be >= 1, got {self.max_tokens_per_microbatch}")
        if self.max_tokens_per_microbatch < self.pad_multiple:
            raise ValueError(f"learner.max_tokens_per_microbatch ({self.max_tokens_per_microbatch}) is below the "
                             f"micro-batch padding multiple {self.pad_multiple}")

    def _check_recompute(self) -> None:
        """The combinations megatron-core's TransformerConfig accepts, as one-line errors here."""
        g, m, n = self.recompute_granularity, self.recompute_method, self.recompute_num_layers
        if g is None:
            if m is not None or n is not None:
                raise ValueError("learner.recompute_method / recompute_num_layers need learner.recompute_granularity")
            return
        if g not in RECOMPUTE_GRANULARITIES:
            raise ValueError(f"learner.recompute_granularity {g!r} is not one of "
                             f"{', '.join(RECOMPUTE_GRANULARITIES)} (or null)")
        if g == "selective":
            if m is not None or n is not None:
                raise ValueError("learner.recompute_granularity=selective takes no recompute_method / "
                                 "recompute_num_layers")
            return
        if m not in RECOMPUTE_METHODS:
            raise ValueError(f"learner.recompute_granularity=full needs recompute_method in "
                             f"{', '.join(RECOMPUTE_METHODS)}, got {m!r}")
        if n is None or n < 1:
            raise ValueError(f"learner.recompute_granularity=full needs recompute_num_layers >= 1, got {n}")

    @property
    def pad_multiple(self) -> int:
        """Micro-batch lengths are padded to a multiple of this: lcm of TP (sequence parallelism
        splits the sequence over the TP ranks), 16 (FP8), 8 x TP (FP8 with sequence parallelism: each
        rank's shard of L/TP tokens must be a multiple of 8) and ``pad_to_multiple``."""
        sp = self.tp if self.sequence_parallel else 1
        fp8 = FP8_TOKEN_MULTIPLE if self.fp8 else 1
        fp8_shard = FP8_LOCAL_SHARD_MULTIPLE * sp if self.fp8 else 1
        return math.lcm(sp, fp8, fp8_shard, self.pad_to_multiple)

    def transformer_overrides(self) -> dict:
        """The megatron-core ``TransformerConfig`` settings this config decides (memory and FP8)."""
        out: dict = dict(sequence_parallel=self.sequence_parallel, recompute_granularity=self.recompute_granularity,
                         recompute_method=self.recompute_method, recompute_num_layers=self.recompute_num_layers)
        if self.fp8 is not None:
            out.update(fp8=self.fp8, fp8_recipe=self.fp8_recipe, fp8_amax_history_len=self.fp8_amax_history_len,
                       fp8_amax_compute_algo=self.fp8_amax_compute_algo)
        if self.moe_aux_loss_coeff is not None:  # MoE models only (the learner refuses them on dense ones)
            out.update(moe_aux_loss_coeff=self.moe_aux_loss_coeff,
                       moe_router_load_balancing_type="aux_loss" if self.moe_aux_loss_coeff > 0 else "none")
        if self.moe_z_loss_coeff > 0:
            out.update(moe_z_loss_coeff=self.moe_z_loss_coeff)
        return out



"""The learner's typed records: its config, one mini-batch to train on, one step's result.

``LossFn`` is the contract between the RL maths and the learner: a pure function of
per-token tensors of one micro-batch, returning a per-token loss (and per-token metrics)
that the learner masks and aggregates so that the result does not depend on how rows are
split into micro-batches and data-parallel ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megatron_tir.rl.loss import AGGREGATIONS  # noqa: F401 - the Learner checks its aggregation against it

DTYPES = ("float32", "bfloat16")
FP8_RECIPES = ("e4m3", "hybrid")
LR_DECAY_STYLES = ("constant", "linear", "cosine")

# loss_fn(logprobs_BT, entropy_BT or None, extras of the micro-batch) -> (per-token loss_BT, per-token metrics)
LossFn = Callable[[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]],
                  tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass(kw_only=True, slots=True)
class LearnerConfig:
    """What the policy learner is: model, layout, precision, optimizer and lr schedule, micro-batching.

    ``model``: ``"smollm2"``, ``"tiny-qwen2"``, an HF directory, or a checkpoint / run
    directory written by the learner or ``tir-ckpt`` (then its weights are loaded; the
    optimizer state is restored by ``Learner.load``). The lr warms up linearly from 0 over
    ``warmup_steps`` optimizer steps (step k uses ``lr * k / warmup_steps``), then follows
    ``lr_decay_style`` down to ``min_lr`` at ``lr_decay_steps`` ("constant": stays at ``lr``).
    """

    model: str = "smollm2"
    tp: int = 1
    pp: int = 1
    dtype: str = "float32"
    lr: float = 1e-6
    min_lr: float = 0.0
    warmup_steps: int = 0
    lr_decay_style: str = "constant"
    lr_decay_steps: int | None = None
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    distributed_optimizer: bool = False
    max_tokens_per_microbatch: int = 4096
    fp8: str | None = None
    seed: int = 1234

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("learner.model must name a model ('smollm2', 'tiny-qwen2', an HF or checkpoint dir)")
        if self.tp < 1 or self.pp < 1:
            raise ValueError(f"learner.tp and learner.pp must be >= 1, got tp={self.tp} pp={self.pp}")
        if self.dtype not in DTYPES:
            raise ValueError(f"learner.dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.fp8 is not None and self.fp8 not in FP8_RECIPES:
            raise ValueError(f"learner.fp8 {self.fp8!r} is not one of {', '.join(FP8_RECIPES)} (or null)")
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


@dataclass(kw_only=True, slots=True)
class TrainBatch:
    """One mini-batch of rows, the same on every rank.

    ``attention_mask_BT`` marks each row's tokens (one contiguous span; padding on either
    side); ``loss_mask_BT`` (float) says which tokens are trained (the trainer has already
    applied the row roles of megatron_tir.rl.rows); ``extras`` are row-aligned tensors
    (``[B]`` or ``[B, T]``: old log-probs, advantages, ...) handed to ``loss_fn`` per micro-batch.
    """

    tokens_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    loss_mask_BT: torch.Tensor
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.tokens_BT.dim() != 2:
            raise ValueError(f"tokens_BT must be [B, T], got shape {tuple(self.tokens_BT.shape)}")
        shape = tuple(self.tokens_BT.shape)
        for name in ("attention_mask_BT", "loss_mask_BT"):
            if tuple(getattr(self, name).shape) != shape:
                raise ValueError(f"{name} has shape {tuple(getattr(self, name).shape)}, tokens_BT {shape}")
        for name, t in self.extras.items():
            if t.shape[0] != shape[0] or (t.dim() == 2 and tuple(t.shape) != shape) or t.dim() > 2:
                raise ValueError(f"extras[{name!r}] has shape {tuple(t.shape)}; expected [{shape[0]}] or {list(shape)}")


@dataclass(kw_only=True, slots=True)
class StepResult:
    """One optimizer step: the mini-batch's loss and metric means, grad norm before clipping,
    whether the step was skipped (non-finite grad norm: weights and optimizer unchanged),
    the lr used, wall-clock timings (seconds) and the padding share of the micro-batches."""

    loss: float
    grad_norm: float
    skipped: bool
    lr: float
    metrics: dict[str, float]
    timings: dict[str, float]
    padding_share: float

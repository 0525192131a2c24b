"""What a learner step takes and returns: one mini-batch, the loss contract, one step's result.

``LossFn`` is the contract between a head's loss and the learner: a function of the model's
output for one micro-batch (whatever the model's head produces: for the policy, its
vocab-parallel logits shard ``[b, L, V/tp]``) and that micro-batch's ``LossInputs`` (token
ids, mask, row-aligned extras), returning a per-token loss ``[b, L]`` (and per-token
metrics) that the learner masks and aggregates so that the result does not depend on how
rows are split into micro-batches and data-parallel ranks. A loss that drops tokens it can
only judge in the forward pass (the high-ratio filter) reports a per-token ``KEEP_METRIC``
(1 kept, 0 dropped): the learner then divides by the kept tokens (rows, for ``seq_mean``)
only, exactly as if the dropped ones had been out of the loss mask. ``OutputFn`` is the forward-only
counterpart (per-token outputs such as log-probs). The policy's losses, built from the
vocab-parallel log-prob / entropy helpers, are in ``megatron_tir.policy.losses``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megatron_tir.rl.loss import AGGREGATIONS, KEEP_METRIC  # noqa: F401 - the Learner's contract


@dataclass(kw_only=True, slots=True, frozen=True)
class LossInputs:
    """One micro-batch as a loss sees it: ``tokens_bL`` (its rows, right-padded to the longest),
    ``mask_bL`` (bool, True on each row's tokens) and ``extras`` (the batch's extras, packed the
    same way: ``[b]`` or ``[b, L]``), all on the model's device."""

    tokens_bL: torch.Tensor
    mask_bL: torch.Tensor
    extras: dict[str, torch.Tensor]


# loss_fn(model output of the micro-batch, its inputs) -> (per-token loss_bL, per-token metrics {name: [b, L]})
LossFn = Callable[[torch.Tensor, LossInputs], tuple[torch.Tensor, dict[str, torch.Tensor]]]
# output_fn(model output of the micro-batch, its inputs) -> per-token outputs {name: [b, L]} (forward only)
OutputFn = Callable[[torch.Tensor, LossInputs], dict[str, torch.Tensor]]
# the policy's per-token loss on log-probs: (logprobs_bL, entropy_bL or None, extras) -> (loss_bL, metrics)
TokenLossFn = Callable[[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]],
                       tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass(kw_only=True, slots=True)
class TrainBatch:
    """One mini-batch of rows, the same on every rank (of a data-parallel replica, with ``local_rows``).

    ``attention_mask_BT`` marks each row's tokens (one contiguous span; padding on either
    side); ``loss_mask_BT`` (float) says which tokens are trained (the trainer has already
    applied the row roles of megatron_tir.rl.rows); ``extras`` are row-aligned tensors
    (``[B]`` or ``[B, T]``: old log-probs, advantages, ...) handed to ``loss_fn`` per micro-batch.
    A pipeline stage that does not read them may hold ``tokens_BT`` / ``loss_mask_BT`` None
    (``Learner.train_step`` with ``local_rows``).
    """

    attention_mask_BT: torch.Tensor
    tokens_BT: torch.Tensor | None
    loss_mask_BT: torch.Tensor | None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.attention_mask_BT.dim() != 2:
            raise ValueError(f"attention_mask_BT must be [B, T], got shape {tuple(self.attention_mask_BT.shape)}")
        shape = tuple(self.attention_mask_BT.shape)
        for name in ("tokens_BT", "loss_mask_BT"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, attention_mask_BT {shape}")
        for name, t in self.extras.items():
            if t.shape[0] != shape[0] or (t.dim() == 2 and tuple(t.shape) != shape) or t.dim() > 2:
                raise ValueError(f"extras[{name!r}] has shape {tuple(t.shape)}; expected [{shape[0]}] or {list(shape)}")


@dataclass(kw_only=True, slots=True)
class StepResult:
    """One optimizer step: the mini-batch's loss and metric means, grad norm before clipping,
    whether the step was skipped (non-finite grad norm: weights and optimizer unchanged),
    the lr used, wall-clock timings (seconds) and the padding share of the micro-batches. ``empty``:
    the mini-batch had no loss token (weights, optimizer and lr schedule unchanged; not ``skipped``,
    which means non-finite gradients)."""

    loss: float
    grad_norm: float
    skipped: bool
    lr: float
    metrics: dict[str, float]
    timings: dict[str, float]
    padding_share: float
    weights_finite: bool = True  # every weight of every rank finite after the step (one reduction)
    empty: bool = False  # the loss mask selected no token (every one masked): no forward, no optimizer step

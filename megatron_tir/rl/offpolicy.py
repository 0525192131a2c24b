"""Deprecated: the former off-policy correction of asynchronous training (``trainer.async.correction``
clamp | mask | off with ``trainer.async.cap``), now modes of the rollout correction
(:mod:`megatron_tir.rl.correction`, ``trainer.correction``): clamp is ``tis``, mask is ``mis``, off is
``none``, each with ``high = cap`` and ``low = 0``. These functions keep the former names and metrics
for callers that still use them; new code calls :func:`megatron_tir.rl.correction.correct`."""

from __future__ import annotations

import torch

from megatron_tir.rl.correction import ASYNC_ALIASES, correct, from_async_alias, named_stats

CORRECTIONS = tuple(ASYNC_ALIASES)


def behaviour_weights_BT(prox_logprobs_BT: torch.Tensor, behav_logprobs_BT: torch.Tensor, *, cap: float = 2.0,
                         mode: str = "clamp") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The detached weight per token, with ``raw`` (the untruncated ratio) and ``capped`` (clamped or
    masked) per token."""
    c = correct(prox_logprobs_BT, behav_logprobs_BT, torch.ones_like(prox_logprobs_BT, dtype=torch.float32),
                from_async_alias(mode, cap))
    w_BT = torch.ones_like(c.rho_BT) if c.weights_BT is None else c.weights_BT
    return w_BT, {"raw": c.rho_BT, "capped": (c.clipped_BT | c.rejected_BT).float()}


def correction_BT(prox_logprobs_BT: torch.Tensor, behav_logprobs_BT: torch.Tensor, loss_mask_BT: torch.Tensor, *,
                  cap: float, mode: str) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """The weights, the loss mask (``mask``: the over-cap tokens out) and the former metrics
    (``weight_mean``, ``weight_max``, ``capped_share``, ``abs_dlogp_mean``, ``kl``)."""
    c = correct(prox_logprobs_BT, behav_logprobs_BT, loss_mask_BT, from_async_alias(mode, cap))
    w_BT = torch.ones_like(c.rho_BT) if c.weights_BT is None else c.weights_BT
    means, maxima = named_stats(c, legacy=True)
    stats = {k.removeprefix("offpolicy/"): s / n for k, (s, n) in means.items() if k.startswith("offpolicy/") and n}
    stats |= {k.removeprefix("offpolicy/"): v for k, v in maxima.items() if k.startswith("offpolicy/")}
    return w_BT, c.loss_mask_BT, stats

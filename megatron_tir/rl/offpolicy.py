"""Off-policy correction for asynchronous rollouts: the decoupled PPO objective.

Three log-probs per token, never one standing in for another (AReaL's decoupled loss,
``areal/utils/functional.py: ppo_actor_loss_fn``; verl's rollout correction,
``verl/trainer/ppo/rollout_corr_helper.py``):

* ``behav``: what the engine reported for the token it sampled (the behaviour policy, possibly
  several weight versions old; with partial rollouts different spans of one row come from
  different versions);
* ``prox``: the learner's own recompute at the start of the step (the proximal policy, which the
  PPO ratio is clipped against);
* ``logp``: the current policy being optimised.

Per token::

    ratio = exp(logp - prox)                        (clipped as in PPO)
    w     = exp(prox - behav)                       (detached behaviour weight)
    clamp: w <- min(w, C)       mask: w <- w if w <= C else 0       off: w <- 1
    loss  = w * ppo_clipped_loss(ratio, A)

With ``behav == prox`` (synchronous training) ``w`` is exactly 1 and the loss is the plain PPO
loss. The weight is truncated importance sampling (C = 2 by default).
"""

from __future__ import annotations

import torch

CORRECTIONS = ("clamp", "mask", "off")


def behaviour_weights_BT(prox_logprobs_BT: torch.Tensor, behav_logprobs_BT: torch.Tensor, *, cap: float = 2.0,
                         mode: str = "clamp") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The detached per-token weight ``w`` above and per-token indicators (``capped``: the weight
    was clamped or masked) plus ``raw`` (the untruncated ratio), for metrics."""
    if mode not in CORRECTIONS:
        raise ValueError(f"off-policy correction must be one of {', '.join(CORRECTIONS)}, got {mode!r}")
    if not cap >= 1:
        raise ValueError(f"the behaviour-weight cap must be >= 1, got {cap}")
    raw_BT = torch.exp((prox_logprobs_BT.float() - behav_logprobs_BT.float()).clamp(-20.0, 20.0)).detach()
    over_BT = raw_BT > cap
    if mode == "off":
        w_BT = torch.ones_like(raw_BT)
    elif mode == "clamp":
        w_BT = raw_BT.clamp(max=cap)
    else:
        w_BT = torch.where(over_BT, torch.zeros_like(raw_BT), raw_BT)
    return w_BT, {"raw": raw_BT, "capped": over_BT.float()}


def correction_BT(prox_logprobs_BT: torch.Tensor, behav_logprobs_BT: torch.Tensor, loss_mask_BT: torch.Tensor, *,
                  cap: float, mode: str) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """The correction of one step's batch, computed once (``prox`` and ``behav`` are fixed for the step).

    Returns the detached weights ``w``, the loss mask (``mask`` mode: tokens whose weight exceeds
    ``cap`` leave it, so they count neither in the loss nor in its denominator, as verl's token
    rejection and AReaL's ``behav_mask`` do) and the step's metrics over the loss tokens *before*
    masking: ``weight_mean`` (of the applied weight on the tokens kept), ``weight_max`` (the largest
    untruncated weight), ``capped_share`` (clamped or masked), ``abs_dlogp_mean`` (mean
    ``|prox - behav|``) and ``kl`` (the k3 estimate ``w - log w - 1`` of KL(behav || prox), the
    samples being the behaviour policy's)."""
    w_BT, info = behaviour_weights_BT(prox_logprobs_BT, behav_logprobs_BT, cap=cap, mode=mode)
    on_BT = loss_mask_BT > 0
    mask_out_BT = loss_mask_BT * (1 - info["capped"]) if mode == "mask" else loss_mask_BT
    n = int(on_BT.sum())
    if n == 0:
        return w_BT, mask_out_BT, {}
    d_BT = (prox_logprobs_BT.float() - behav_logprobs_BT.float()).clamp(-20.0, 20.0)
    kept_BT = mask_out_BT > 0
    stats = {
        "weight_mean": float(w_BT[kept_BT].mean()) if bool(kept_BT.any()) else 0.0,
        "weight_max": float(info["raw"][on_BT].max()),
        "capped_share": float(info["capped"][on_BT].mean()),
        "abs_dlogp_mean": float(d_BT[on_BT].abs().mean()),
        "kl": float((torch.exp(d_BT) - d_BT - 1)[on_BT].mean()),
    }
    return w_BT, mask_out_BT, stats

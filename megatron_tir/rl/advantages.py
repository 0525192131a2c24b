"""Advantage estimators without a critic: GRPO (group-relative), Dr. GRPO and Reinforce++ (batch-normalised).

:data:`ADVANTAGE_ESTIMATORS` names them all with one signature,
``(rewards_B, group_index_B, stats_B, mask_BT) -> advantages_BT`` (0 outside ``mask_BT``'s model
tokens and on rows outside the statistics); ``trainer.ppo.advantage`` is a key of it. Adding an
estimator is a function of that signature and a line in the registry. Each takes an outcome reward per trajectory (``rewards_B``) and a boolean ``stats_B`` that says
which rows enter the statistics (see :func:`megatron_tir.rl.rows.row_weights`: void rows do,
tool-failed and aborted rows do not). Rows outside the statistics get advantage 0.
Standard deviations are the unbiased (n - 1) estimate, as torch.std; a group or batch with
fewer than two counted rows has std 0.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def _masked_std(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, unbiased std) of ``x`` over ``mask``; 0 where fewer than 1 / 2 entries count."""
    n = mask.sum()
    mean = (x * mask).sum() / n.clamp(min=1)
    var = (((x - mean) * mask) ** 2).sum() / (n - 1).clamp(min=1)
    return mean, var.sqrt()


def grpo_advantages_B(rewards_B: torch.Tensor, group_index_B: torch.Tensor, stats_B: torch.Tensor, *,
                      std_normalize: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: ``A_i = (r_i - mean_g) / (std_g + eps)`` over the counted rows of row i's group g
    (``std_normalize=False``: ``A_i = r_i - mean_g``, Dr. GRPO). Every sampled trajectory
    that counts shapes its group's mean and std, whether or not it is trained on."""
    assert rewards_B.shape == group_index_B.shape == stats_B.shape and rewards_B.dim() == 1
    rewards_B = rewards_B.float()
    stats_B = stats_B.bool()
    adv_B = torch.zeros_like(rewards_B)
    for g in torch.unique(group_index_B):
        in_g = (group_index_B == g) & stats_B
        if not in_g.any():
            continue
        mean, std = _masked_std(rewards_B, in_g.float())
        a = rewards_B - mean
        if std_normalize and std + eps > 0:  # a zero-std group has a = 0 already
            a = a / (std + eps)
        adv_B = torch.where(in_g, a, adv_B)
    return adv_B


def reinforce_pp_advantages_BT(rewards_B: torch.Tensor, mask_BT: torch.Tensor, stats_B: torch.Tensor, *,
                               gamma: float = 1.0, eps: float = 1e-8) -> torch.Tensor:
    """Reinforce++: per-token discounted returns of the outcome reward, whitened over the batch.

    The return of model token t of row b is ``r_b * gamma ** k`` where k is the number of
    model tokens after t (feedback tokens do not count as steps); the returns are then
    normalised by the mean and std over all model tokens of the counted rows (no critic).
    Result is 0 outside ``mask_BT`` and on rows outside the statistics.
    """
    assert mask_BT.dim() == 2 and rewards_B.shape == stats_B.shape == mask_BT.shape[:1]
    mask_BT = mask_BT.float()
    after_BT = mask_BT.flip(1).cumsum(1).flip(1) - mask_BT  # model tokens strictly after t
    returns_BT = rewards_B.float()[:, None] * torch.pow(torch.tensor(gamma), after_BT)
    counted_BT = mask_BT * stats_B.float()[:, None]
    mean, std = _masked_std(returns_BT, counted_BT)
    return (returns_BT - mean) / (std + eps) * counted_BT


def reinforce_pp_baseline_advantages_BT(rewards_B: torch.Tensor, group_index_B: torch.Tensor, stats_B: torch.Tensor,
                                        mask_BT: torch.Tensor, *, eps: float = 1e-8) -> torch.Tensor:
    """REINFORCE++-baseline (OpenRLHF ``advantage_estimator=reinforce_baseline``, the variant
    ZeroTIR's example script uses): subtract the group's mean reward (over its counted rows; no
    division by the group std), broadcast the result to every model token of the row (gamma = 1),
    then whiten over all model tokens of the counted rows of the batch. 0 outside ``mask_BT`` and
    on rows outside the statistics."""
    assert mask_BT.dim() == 2 and rewards_B.shape == group_index_B.shape == stats_B.shape == mask_BT.shape[:1]
    centred_B = grpo_advantages_B(rewards_B, group_index_B, stats_B, std_normalize=False)
    counted_BT = mask_BT.float() * stats_B.float()[:, None]
    returns_BT = centred_B[:, None] * counted_BT
    mean, std = _masked_std(returns_BT, counted_BT)
    return (returns_BT - mean) / (std + eps) * counted_BT


# (rewards_B, group_index_B, stats_B, mask_BT) -> advantages_BT
AdvantageEstimator = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _per_token(adv_B: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    return adv_B[:, None] * (mask_BT > 0).float()


def grpo_BT(rewards_B, group_index_B, stats_B, mask_BT) -> torch.Tensor:
    """GRPO (:func:`grpo_advantages_B`, std-normalised) on every model token of its row."""
    return _per_token(grpo_advantages_B(rewards_B, group_index_B, stats_B, std_normalize=True), mask_BT)


def dr_grpo_BT(rewards_B, group_index_B, stats_B, mask_BT) -> torch.Tensor:
    """Dr. GRPO: the group mean subtracted, no division by the group std."""
    return _per_token(grpo_advantages_B(rewards_B, group_index_B, stats_B, std_normalize=False), mask_BT)


def reinforce_pp_BT(rewards_B, group_index_B, stats_B, mask_BT) -> torch.Tensor:
    """Reinforce++ (:func:`reinforce_pp_advantages_BT`, gamma 1); groups play no part."""
    del group_index_B
    return reinforce_pp_advantages_BT(rewards_B, mask_BT, stats_B)


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": grpo_BT,
    "dr_grpo": dr_grpo_BT,
    "reinforce_pp": reinforce_pp_BT,
    "reinforce_pp_baseline": reinforce_pp_baseline_advantages_BT,
}

# Estimators computed per token from a critic's values, on every rank (``megatron_tir.rl.critic.gae_BT``,
# ``megatron_tir.train.algorithm.CriticPPO``), not per group on rank 0 before the hand-off.
CRITIC_ESTIMATORS: tuple[str, ...] = ("gae",)
ESTIMATOR_NAMES: tuple[str, ...] = (*ADVANTAGE_ESTIMATORS, *CRITIC_ESTIMATORS)


def needs_values(name: str) -> bool:
    """Whether estimator ``name`` needs a critic's values (ValueError for a name that is no estimator;
    an estimator added to ADVANTAGE_ESTIMATORS at run time counts)."""
    if name not in ADVANTAGE_ESTIMATORS and name not in CRITIC_ESTIMATORS:
        raise ValueError(f"advantage must be one of {', '.join((*ADVANTAGE_ESTIMATORS, *CRITIC_ESTIMATORS))}, "
                         f"got {name!r}")
    return name in CRITIC_ESTIMATORS

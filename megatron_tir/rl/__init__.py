"""RL maths as pure tensor functions: advantages, the policy loss, which rows count where, filters."""

from megatron_tir.rl.advantages import (
           ADVANTAGE_ESTIMATORS,
           CRITIC_ESTIMATORS,
           ESTIMATOR_NAMES,
           AdvantageEstimator,
           grpo_advantages_B,
           needs_values,
           reinforce_pp_advantages_BT,
)
from megatron_tir.rl.loss import (
           AGGREGATIONS,
           LossConfig,
           PolicyLoss,
           aggregate,
           clipped_surrogate_BT,
           kl_k3_BT,
)
from megatron_tir.rl.rows import (
           MODES,
           OVERLONG,
           ModeSpec,
           group_keep_G,
           low_prob_keep_BT,
           row_weights,
)

__all__ = [
           "ADVANTAGE_ESTIMATORS",
           "CRITIC_ESTIMATORS",
           "ESTIMATOR_NAMES",
           "AGGREGATIONS",
           "AdvantageEstimator",
           "MODES",
           "OVERLONG",
           "LossConfig",
           "ModeSpec",
           "PolicyLoss",
           "aggregate",
           "clipped_surrogate_BT",
           "group_keep_G",
           "grpo_advantages_B",
           "kl_k3_BT",
           "low_prob_keep_BT",
           "needs_values",
           "reinforce_pp_advantages_BT",
           "row_weights",
]

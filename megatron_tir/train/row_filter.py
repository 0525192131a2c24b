"""The per-row eval filter (ZeroTIR's ``--use_eval_filter``): rows that leave the loss for what their
answer check or their text says, decided on rank 0 from the trajectories.

Read from yyht/openrlhf_async_pipline at 63b6159, ``openrlhf/trainer/ppo_utils/replay_buffer.py``
``filter_eval_fail``: a row whose reward service failed (``rule_eval_fails`` or ``model_eval_fails``)
or whose ``repeatness`` exceeds 0.05 leaves the replay buffer, after the accuracy filter and only
once the actor trains (``ppo_trainer.py``: ``all_gather`` runs when ``steps > freezing_actor_steps``).
Here such a row leaves the loss (:func:`megatron_tir.rl.rows.row_weights`' ``excluded_B``) and stays in
its group's statistics, which the accuracy filter has already read.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_tir.observe.zerotir import repeat_score, response_text
from megatron_tir.rollout.trajectory import Trajectory


def eval_filter_rules(trajs: Sequence[Trajectory], *, max_repeat_score: float | None,
                      drop_verifier_failures: bool) -> list[str | None] | None:
    """Per row (in ``trajs``' order: the collated batch's), the rule that keeps it out of the loss
    (``verifier_failed``, ``repeats``) or None; None when the filter is off."""
    if max_repeat_score is None and not drop_verifier_failures:
        return None
    out = []
    for t in trajs:
        if drop_verifier_failures and t.reward_failed:
            out.append("verifier_failed")
        elif max_repeat_score is not None and repeat_score(response_text(t)) > max_repeat_score:
            out.append("repeats")
        else:
            out.append(None)
    return out


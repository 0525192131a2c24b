"""Crafted trajectories and groups (no model): the rollout records with chosen statuses and rewards."""

from __future__ import annotations

import math

from megatron_tir.rollout.batch import Group
from megatron_tir.rollout.trajectory import FinishStatus, Trajectory


def traj(group: int, sample: int, status: FinishStatus, reward: float, *, logprobs=(-0.5, -1.0, -2.0),
         feedback: int = 0) -> Trajectory:
    t = Trajectory(group_id=group, sample_index=sample, prompt_ids=[1, 2])
    t.append_model_tokens([10 + i for i in range(len(logprobs))], list(logprobs), [0] * len(logprobs))
    if feedback:
        t.append_feedback_tokens([5] * feedback)
    t.status, t.reward = status, reward
    return t


def group(gid: int, *specs) -> Group:
    """``specs``: (status, reward) or (status, reward, logprobs) per trajectory."""
    return Group(group_id=gid, problem=None,
                 trajectories=[traj(gid, i, s[0], s[1], **({"logprobs": s[2]} if len(s) > 2 else {}))
                               for i, s in enumerate(specs)])


C, V, F, A, T = (FinishStatus.COMPLETED, FinishStatus.VOID, FinishStatus.TOOL_FAILED, FinishStatus.ABORTED,
                 FinishStatus.TRUNCATED)
NAN = math.nan

"""The turn schedule: switch to the larger budget (SimpleTIR: 5 -> 10 turns, 16K -> 24K tokens)
at a given step, or once the mean response length has plateaued."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from megatron_tir.rollout import RolloutConfig
from megatron_tir.train.config import TrainerConfig


def plateaued(lengths: Sequence[float], *, window: int, tolerance: float) -> bool:
    """The mean of the last ``window`` values differs from the mean of the ``window`` before
    them by at most ``tolerance`` (relative)."""
    if len(lengths) < 2 * window:
        return False
    before = sum(lengths[-2 * window:-window]) / window
    last = sum(lengths[-window:]) / window
    return abs(last - before) <= tolerance * max(abs(before), 1e-9)


def schedule_due(step: int, cfg: TrainerConfig, lengths: Sequence[float]) -> bool:
    """Does the budget switch take effect at ``step`` (``lengths``: mean response length per step so far)?"""
    if cfg.schedule_at_step is not None and step >= cfg.schedule_at_step:
        return True
    return cfg.schedule_on_plateau and plateaued(lengths, window=cfg.plateau_window,
                                                 tolerance=cfg.plateau_tolerance)


def switched(rollout: RolloutConfig, cfg: TrainerConfig) -> RolloutConfig:
    return dataclasses.replace(rollout, max_turns=cfg.schedule_max_turns,
                               max_response_tokens=cfg.schedule_max_response_tokens)

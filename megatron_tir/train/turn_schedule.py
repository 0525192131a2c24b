"""The turn schedule: switch to the larger budget (SimpleTIR: 5 -> 10 turns, 16K -> 24K tokens)
at a given step, or once the mean response length has plateaued."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from dataclasses import dataclass

from megatron_tir.rollout import RolloutConfig


@dataclass(kw_only=True, slots=True)
class TurnScheduleConfig:
    """Switch to the larger budget at a step, or when the mean response length plateaus."""
    at_step: int | None = None  # switch to the larger budget at this step; None: not by step
    on_plateau: bool = False  # switch when the mean response length plateaus
    plateau_window: int = 10  # steps compared: the last window vs the one before
    plateau_tolerance: float = 0.02  # relative change of the mean response length below which it plateaued
    max_turns: int = 10  # rollout.max_turns after the switch
    max_response_tokens: int = 24576  # rollout.max_response_tokens after the switch

    def __post_init__(self) -> None:
        for name in ("plateau_window", "max_turns", "max_response_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.at_step is not None and self.at_step < 1:
            raise ValueError(f"at_step must be >= 1 or null, got {self.at_step}")
        if not self.plateau_tolerance >= 0:
            raise ValueError(f"plateau_tolerance must be >= 0, got {self.plateau_tolerance}")


def plateaued(lengths: Sequence[float], *, window: int, tolerance: float) -> bool:
    """The mean of the last ``window`` values differs from the mean of the ``window`` before
    them by at most ``tolerance`` (relative)."""
    if len(lengths) < 2 * window:
        return False
    before = sum(lengths[-2 * window:-window]) / window
    last = sum(lengths[-window:]) / window
    return abs(last - before) <= tolerance * max(abs(before), 1e-9)


def schedule_due(step: int, cfg: TurnScheduleConfig, lengths: Sequence[float]) -> bool:
    """Does the budget switch take effect at ``step`` (``lengths``: mean response length per step so far)?"""
    if cfg.at_step is not None and step >= cfg.at_step:
        return True
    return cfg.on_plateau and plateaued(lengths, window=cfg.plateau_window,
                                                 tolerance=cfg.plateau_tolerance)


def switched(rollout: RolloutConfig, cfg: TurnScheduleConfig) -> RolloutConfig:
    return dataclasses.replace(rollout, max_turns=cfg.max_turns, max_response_tokens=cfg.max_response_tokens)

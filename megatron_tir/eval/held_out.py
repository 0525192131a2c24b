"""The trainer's held-out evaluation: the current weights on the held-out prompts, with the run's
rollout budgets and the evaluation's own sampling (``data.eval_samples`` samples per prompt,
``data.eval_temperature`` / ``data.eval_top_p`` or the rollout's, seed ``trainer.seed + 1``).

Rank 0 runs it on the rollout service (``train/loop.py`` calls ``Producer.evaluate`` inside a rank-0
phase: the other ranks wait through the hand-off). ``hold(True)`` pauses generation that runs ahead
(``trainer.async=full``) while it evaluates; ``hold(False)`` lets it go on.
"""

from __future__ import annotations

import dataclasses
import time


def run_held_out(service, cfg, rollout_cfg, problems, *, hold) -> tuple[list, float]:
    """The held-out groups and the seconds they took. ``cfg``: the run's ``TrainConfig``."""
    T = cfg.data.eval_temperature if cfg.data.eval_temperature is not None else rollout_cfg.temperature
    top_p = cfg.data.eval_top_p if cfg.data.eval_top_p is not None else rollout_cfg.top_p
    ecfg = dataclasses.replace(rollout_cfg, n_samples=cfg.data.eval_samples, temperature=T, top_p=top_p,
                               seed=cfg.trainer.seed + 1)
    t0 = time.perf_counter()
    service.waiting()
    hold(True)  # full: the evaluation first, then generation ahead again
    try:
        groups = service.rollout(problems, ecfg, group_id_offset=0, progress=cfg.trainer.progress, desc="eval")
    finally:
        hold(False)
    return groups, time.perf_counter() - t0

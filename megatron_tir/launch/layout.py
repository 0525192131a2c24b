"""What the launcher needs from the training config: the recipe's model and parallel layout.

This is the launcher's one contact with ``megatron_tir.train.config``; everything else in
``megatron_tir.launch`` works from a :class:`TrainerLayout` (the capacity planner, ``plan``,
reads the whole config that :func:`train_config` returns).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_tir.train.config import apply_overrides, from_dict
from megatron_tir.train.recipes import load_recipe


@dataclass(kw_only=True, slots=True, frozen=True)
class TrainerLayout:
    model: str  # the recipe's model name (the cluster file may map it to a path)
    tp: int
    pp: int
    sandbox_workers: int  # the recipe's local sandbox size (runs on this machine)
    routed_experts: bool = False  # the rollouts ask for routed experts (routing_replay=rollout): the servers capture them

    def __post_init__(self) -> None:
        assert self.tp >= 1 and self.pp >= 1, (self.tp, self.pp)


def trainer_layout(*, recipe: str | None = None, run_dir: str | Path | None = None,
                   overrides: Sequence[str] = ()) -> TrainerLayout:
    """The layout of a new run of ``recipe``, or of the run in ``run_dir`` (its resolved
    ``config.json``), with the user's ``--set`` overrides applied and validated."""
    cfg = train_config(recipe=recipe, run_dir=run_dir, overrides=overrides)
    return TrainerLayout(model=cfg.model, tp=cfg.learner.tp, pp=cfg.learner.pp, sandbox_workers=cfg.sandbox.workers,
                         routed_experts=cfg.rollout.routed_experts)


def train_config(*, recipe: str | None = None, run_dir: str | Path | None = None, overrides: Sequence[str] = ()):
    """The training config of a new run of ``recipe`` or of the run in ``run_dir``, overrides applied
    (what the layout and the capacity planner read)."""
    assert (recipe is None) != (run_dir is None), "give a recipe or a run dir"
    if recipe is not None:
        cfg = load_recipe(recipe)
    else:
        path = Path(run_dir) / "config.json"
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise ValueError(f"--resume {run_dir}: cannot read {path.name} ({exc.strerror})") from None
        except json.JSONDecodeError:
            raise ValueError(f"--resume {run_dir}: {path.name} is not valid JSON") from None
        cfg = from_dict(data)
    return apply_overrides(cfg, overrides)

"""The ``local`` engine kind: the in-process torch engine (CPU default), synced through rank 0.

Its one line in :data:`megatron_tir.rollout.factory.ENGINE_KINDS` is ``"local": LOCAL``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from megatron_tir.rollout.engines.base import EngineKind, PauseMode
from megatron_tir.rollout.sync.base import through_rank0

if TYPE_CHECKING:
    from megatron_tir.rollout.factory import EngineConfig


def check(cfg: EngineConfig) -> None:
    if cfg.urls:
        raise ValueError("engine urls are only used with engine kind 'sglang'")
    if cfg.colocated:
        raise ValueError("engine colocated is only used with engine kind 'sglang'")


def settings(cfg: EngineConfig, model_dir: Path):
    from megatron_tir.rollout.engines.local import LocalEngineConfig

    return LocalEngineConfig(model=str(model_dir), max_batch_size=cfg.max_batch_size, seed=cfg.seed)


def build(cfg: EngineConfig, settings, model_dir: Path):
    from megatron_tir.rollout.engines.local import LocalEngine

    engine = LocalEngine(settings)
    return engine, engine.tokenizer


def engine_sync(cfg: EngineConfig, engine, pause_mode: PauseMode):
    from megatron_tir.rollout.sync.local import LocalWeightSync

    return LocalWeightSync(engine, pause_mode=pause_mode)


def before_wait() -> None:
    from megatron_tir.rollout.engines.openmp import release_idle_threads

    release_idle_threads()  # the engine steps on its own thread: this one's idle OpenMP team would slow it


LOCAL = EngineKind(check=check, where=lambda cfg: f"local engine ({cfg.model})", settings=settings, build=build,
                   engine_sync=engine_sync, weight_sync=through_rank0, before_wait=before_wait)

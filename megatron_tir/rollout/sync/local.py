"""Weight sync into the in-process :class:`~megatron_tir.rollout.engines.local.LocalEngine`.

pause -> copy every tensor into the model (one ``update_weights``: names and shapes are
checked before anything is copied) -> resume. The engine counts the update: its
``weight_version`` goes up by one.

The LocalEngine shares the trainer's device, so it follows the colocated contract too:
``offload()`` (pause, release all memory tags) before a training phase, then the update
resumes ``weights``, loads, resumes ``kv_cache`` + ``cuda_graph`` and resumes generation.
Its release/resume free nothing, but they are called, and checked, in SGLang's order.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from megatron_tir.rollout.engines.base import MEMORY_TAGS, PauseMode
from megatron_tir.rollout.engines.base import pause_mode as as_pause_mode
from megatron_tir.rollout.sync.base import WEIGHTS_TAG, Bucket, check_bucket

if TYPE_CHECKING:
    from megatron_tir.rollout.engines.local import LocalEngine


class LocalWeightSync:
    """See the module docstring. ``pause_mode``: what happens to requests in flight (PauseMode)."""

    def __init__(self, engine: LocalEngine, *, pause_mode: PauseMode | str = PauseMode.ABORT) -> None:
        self.engine = engine
        self.pause_mode = as_pause_mode(pause_mode)
        self.next_version: int | None = None  # a resumed run's version for the next update (EngineWeightSync)

    async def start(self) -> None:
        return None

    async def offload(self) -> None:
        await self.engine.pause(mode=self.pause_mode)
        await self.engine.release_memory_occupation(list(MEMORY_TAGS))

    async def update(self, buckets: Iterable[Bucket]) -> int:
        named = [item for bucket in buckets for item in check_bucket(bucket)]
        engine = self.engine
        released = engine.released_memory
        if not released:
            await engine.pause(mode=self.pause_mode)
        try:
            if WEIGHTS_TAG in released:
                await engine.resume_memory_occupation([WEIGHTS_TAG])
            await engine.update_weights(named, version=self.next_version)
            self.next_version = None
        finally:
            await engine.resume_memory_occupation()  # the rest (kv_cache, cuda_graph)
            await engine.resume()
        return engine.weight_version

    async def close(self) -> None:
        return None


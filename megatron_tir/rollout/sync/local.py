"""Weight sync into the in-process :class:`~megatron_tir.rollout.engines.local.LocalEngine`.

pause -> copy every tensor into the model (one ``update_weights``: names and shapes are
checked before anything is copied) -> resume. The engine counts the update: its
``weight_version`` goes up by one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from megatron_tir.rollout.engines.base import PauseMode
from megatron_tir.rollout.engines.base import pause_mode as as_pause_mode
from megatron_tir.rollout.sync.base import Bucket, check_bucket

if TYPE_CHECKING:
    from megatron_tir.rollout.engines.local import LocalEngine


class LocalWeightSync:
    """See the module docstring. ``pause_mode``: what happens to requests in flight (PauseMode)."""

    def __init__(self, engine: LocalEngine, *, pause_mode: PauseMode | str = PauseMode.ABORT) -> None:
        self.engine = engine
        self.pause_mode = as_pause_mode(pause_mode)

    async def start(self) -> None:
        return None

    async def update(self, buckets: Iterable[Bucket]) -> int:
        named = [item for bucket in buckets for item in check_bucket(bucket)]
        await self.engine.pause(mode=self.pause_mode)
        try:
            await self.engine.update_weights(named)
        finally:
            await self.engine.resume()
        return self.engine.weight_version

    async def close(self) -> None:
        return None


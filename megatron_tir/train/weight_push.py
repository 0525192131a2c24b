"""The engine's side of an update, on every trainer rank: its memory freed before the update, the
learner's new weights pushed into it after.

    weights.free_engine(step)                      # before the update (rank 0's engine; the others wait)
    weights.after_update(step, policy, timings)    # rollouts run ahead drained, then update(policy)

``update(learner)`` goes through the engine kind's weight sync
(:func:`megatron_tir.rollout.factory.build_weight_sync`, ``update(source)`` on every rank); a sync
whose collectives span every rank waits for rank 0 through the hand-off first
(:meth:`~megatron_tir.train.handoff.HandOff.before_sync`). While it runs, rank 0's engine
idle-share clock stops; after it, rank 0's producer may admit more groups (``full``).
"""

from __future__ import annotations

import contextlib

from megatron_tir.rollout.engines.base import PauseMode
from megatron_tir.rollout.factory import build_weight_sync
from megatron_tir.train.algorithm import timed
from megatron_tir.train.config import TrainConfig
from megatron_tir.train.handoff import HandOff


class WeightPush:
    """Built collectively (every rank); ``producer`` is rank 0's
    :class:`~megatron_tir.train.producer.Producer` (None elsewhere)."""

    def __init__(self, cfg: TrainConfig, handoff: HandOff, producer) -> None:
        self._handoff, self._producer = handoff, producer
        self._service = None if producer is None else producer.service
        # with trainer.async=full a sync retracts the requests in flight, which continue under the new weights
        full = cfg.trainer.asynchrony.mode == "full"
        self.sync = build_weight_sync(cfg.engine, self._service,
                                      pause_mode=PauseMode.RETRACT if full else PauseMode.ABORT)

    def free_engine(self, step: int) -> None:
        """Before the update (collective): rank 0's engine frees its memory where it shares the trainer's
        devices (colocated SGLang; the local engine's no-op release), taken back by the next ``update``;
        the other ranks wait for it through the hand-off. Skipped while a later step's rollouts are in
        flight: they need the engine (:meth:`~megatron_tir.train.producer.Producer.release_engine`)."""
        release = self._producer.release_engine if self._producer is not None else lambda: None
        self._handoff.rank0_phase(f"offload/{step}", release, what=f"rank 0 to free the engine's memory (step {step})")
        self._handoff.forget(f"offload/{step - 2}")

    def after_update(self, step: int, learner, timings: dict[str, float]) -> None:
        """After step ``step``'s update: rank 0 first waits for the rollouts started ahead of the next step to
        finish generating (``time/drain``: each group comes from one weight version), then ``update``
        (``time/sync``)."""
        if self._producer is not None and (drained_s := self._producer.drain_ahead(step)) is not None:
            timings["time/drain"] = drained_s
        with timed(timings, "sync"):
            self.update(learner)

    def update(self, learner, *, version: int | None = None) -> None:
        """The learner's weights into the engine (collective: every rank calls it); ``version``: the weight
        version the engine gets (a resumed run continues its numbering), default one more than its own."""
        if self.sync.wait_for_rank0:
            self._handoff.before_sync()
        with self._engine_paused():
            if version is None:
                self.sync.update(learner)
            else:
                self.sync.update(learner, version=version)
        if self._producer is not None:  # full: the new version may admit more groups
            self._producer.poke()

    def _engine_paused(self):
        """Rank 0: the engine's idle-share clock stops while a sync holds it (``EngineActivity.paused``)."""
        activity = getattr(self._service, "activity", None)
        return activity.paused() if activity is not None else contextlib.nullcontext()

    def close(self) -> None:
        self.sync.close()

"""The rollout source: rank 0 produces a step's rollouts, every rank consumes the rows it trains.

    got = source.take(step)      # every rank: this rank's share of the trained rows (or none)

Every rank calls it; which rank produces is hidden here. On rank 0 the
:class:`~megatron_tir.train.rollouts.RolloutService` (engine, sandbox, verifier) runs the
rollouts on its own event-loop thread, so the main thread is free while they run (asynchronous
training builds on that; ``submit`` starts a step early). ``take`` then, on rank 0: dynamic sampling's group
filter (per-row summaries, no ``[B, T]`` tensors), the row roles and advantages over every
counted row (:func:`~megatron_tir.train.batch.plan_update`), the rows no mode trains removed,
each data-parallel replica's share dealt (:func:`~megatron_tir.train.batch.deal_rows`), and the
hand-off (:class:`~megatron_tir.train.handoff.HandOff`: a header through the job's store, each TP
group's rows once, the other ranks waiting on rank 0's heartbeat rather than in a collective).
Every rank-0-only phase (held-out evaluation, the engine's offload) goes through the same
hand-off (:meth:`RolloutSource.rank0_phase`).

A step stops the run (:class:`TrainingStopped`, exit 1, nothing saved) when infrastructure
ended more than ``trainer.stop.infra_failure_share`` of its trajectories.

What rank 0 produces, and how (``trainer.async``: off, one_step, full), is rank 0's
:class:`~megatron_tir.train.producer.Producer`; the held-out evaluation is
:func:`megatron_tir.eval.held_out.run_held_out`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass

from megatron_tir.rl import needs_values
from megatron_tir.rollout.factory import InfrastructureError, build_weight_sync
from megatron_tir.rollout.batch import Group, RowFate, collate
from megatron_tir.train.batch import TrainRows, plan_update
from megatron_tir.train.config import TrainConfig
from megatron_tir.train.handoff import HandOff, one_line
from megatron_tir.train.producer import Producer

log = logging.getLogger(__name__)

class TrainingStopped(InfrastructureError):
    """The run cannot learn: a one-line cause (exit 1); the checkpoints already written stay."""


@dataclass(kw_only=True, slots=True)
class StepRollouts:
    """One rank's part of a step's rollouts."""
    rows: TrainRows | None  # this rank's share of the trained rows; None: no row is trained this step
    mini_batches: int  # mini-batches of the update (the same on every rank)
    metrics: dict[str, float]  # rank 0: rollout and filter metrics; other ranks: {}
    data_position: int  # the prompt stream's position after the step (full: the first position not consumed)
    schedule_switched_at: int | None
    rollout_budget: tuple[int, int]  # (max turns, max response tokens) the step sampled with
    turns: int  # turns of the longest trained row (the per-turn diagnostics' size, the same on every rank)
    sampled: list[Group]  # rank 0: every group the step sampled (the observers'); elsewhere []
    fates: dict[tuple[int, int], RowFate]  # rank 0: what the step decided for each sampled row; elsewhere {}
    data_consumed_ahead: list[int] = dataclasses.field(default_factory=list)  # full: consumed positions past it

    @classmethod
    def of_groups(cls, groups, cfg: TrainConfig, *, pad_id: int = 0) -> StepRollouts:
        """A one-replica step of scored ``groups`` without a source (what ``next`` gives a rank when
        the data-parallel size is 1; for checks of the update alone)."""
        tc = cfg.trainer
        plan = plan_update(collate(groups, pad_id=pad_id), mode=tc.mode,
                           advantage=None if needs_values(tc.ppo.advantage) else tc.ppo.advantage,
                           overlong=tc.filters.overlong, mini_batches=tc.ppo.mini_batches)
        r = plan.rows
        return cls(rows=r if r.batch_size else None, mini_batches=int(r.mini_batch_B.max()) + 1 if r.batch_size else 0,
                   metrics={}, data_position=0, schedule_switched_at=None,
                   rollout_budget=(cfg.rollout.max_turns, cfg.rollout.max_response_tokens),
                   turns=int(r.turn_index_BT.max()) + 1 if r.batch_size else 0, sampled=[], fates={})


# ----------------------------------------------------------------------------- the source


class RolloutSource:
    """Every rank builds one (collectively) and calls ``submit`` / ``next`` each step.

    ``service_factory()`` is called on rank 0 only and returns the started
    :class:`~megatron_tir.train.rollouts.RolloutService` (engine, sandbox, verifier, event-loop
    thread; checked the way ``eval`` checks them); a failure there ends every rank with its
    one-line cause. ``position`` and ``schedule_switched_at`` come from the trainer state.
    """

    def __init__(self, cfg: TrainConfig, *, service_factory, position: int = 0,
                 schedule_switched_at: int | None = None, pad_id: int | None = None,
                 poll_s: float = 1.0, alive_timeout_s: float = 300.0, consumed_ahead=()) -> None:
        self.cfg = cfg
        self.full = cfg.trainer.asynchrony.mode == "full"
        self._handoff = HandOff(poll_s=poll_s, alive_timeout_s=alive_timeout_s)
        self.rank = self._handoff.rank
        self.service = None
        self.producer: Producer | None = None  # rank 0's (train/producer.py)
        self.schedule_switched_at = schedule_switched_at
        if self.rank == 0:
            try:
                self.service = service_factory()
                self.producer = Producer(cfg, self.service, position=position, consumed_ahead=consumed_ahead,
                                         schedule_switched_at=schedule_switched_at, pad_id=pad_id,
                                         dp_size=self._handoff.dp_size)
            except BaseException as exc:
                self._handoff.publish("start", {"error": one_line(exc, 10_000)})
                self._handoff.close()
                if self.service is not None:
                    self.service.close()
                raise
            self._handoff.publish("start", {"error": None})
        else:
            header, _ = self._handoff.receive("start", what="rank 0's engine and sandbox to start")
            if header["error"] is not None:
                self._handoff.close()
                raise InfrastructureError(f"rank 0 could not start the rollouts: {header['error']}")
        self.weights = None  # the engine kind's weight sync, on every rank (update(source))
        self._syncs = 0  # syncs that waited for rank 0 first: the hand-off key each waits on
        try:
            self.weights = self._start_weight_sync()
        except BaseException:
            self.close()
            raise

    def _start_weight_sync(self):
        """The engine kind's :class:`~megatron_tir.rollout.sync.base.WeightSync`, built and started on
        every rank at once (``megatron_tir.rollout.factory.ENGINE_KINDS``); with ``trainer.async=full``
        a sync retracts the requests in flight, which continue under the new weights."""
        from megatron_tir.rollout.engines.base import PauseMode

        return build_weight_sync(self.cfg.engine, self.service,
                                 pause_mode=PauseMode.RETRACT if self.full else PauseMode.ABORT)

    @property
    def rollout_cfg(self):
        """Rank 0's rollout budgets now (the turn schedule may have switched them); None elsewhere."""
        return None if self.producer is None else self.producer.rollout_cfg

    @property
    def received_bytes(self) -> int:
        return self._handoff.received_bytes

    def submit(self, step: int) -> None:
        """Start step ``step``'s rollouts early (rank 0, on the event-loop thread; elsewhere nothing)."""
        if self.rank == 0:
            self.producer.submit(step)

    def take(self, step: int) -> StepRollouts:
        """This rank's share of step ``step``'s trained rows (blocks until rank 0 has them): rank 0's
        producer takes them (:meth:`~megatron_tir.train.producer.Producer.take`: started now unless they
        already run; ``one_step`` starts step + 1's) and the hand-off deals them."""
        key = f"step/{step}"
        if self.rank != 0:
            header, rows = self._handoff.receive(key, what=f"step {step}'s rollouts")
            return self._result(header, rows, {}, [], {})
        try:
            produced = self.producer.take(step)
        except BaseException as exc:  # the other ranks end with the cause instead of waiting for rank 0's exit
            self._handoff.publish(key, {"stop": f"rank 0 failed in step {step}'s rollouts: {one_line(exc)}"})
            raise
        rows = self._handoff.publish(key, produced.header, produced.shares)
        self._handoff.forget(f"step/{step - 2}")  # every rank has read it: they trained step - 1 together
        return self._result(produced.header, rows, produced.metrics, produced.collected.sampled, produced.fates)

    def _result(self, header: dict, rows: TrainRows | None, metrics: dict, sampled: list[Group],
                fates: dict) -> StepRollouts:
        if header["stop"] is not None:
            raise TrainingStopped(header["stop"])
        self.schedule_switched_at = header["schedule_switched_at"]
        return StepRollouts(rows=rows, mini_batches=header["mini_batches"], metrics=metrics,
                            data_position=header["data_position"], schedule_switched_at=header["schedule_switched_at"],
                            rollout_budget=tuple(header["budget"]), turns=header["turns"], sampled=sampled, fates=fates,
                            data_consumed_ahead=list(header.get("consumed_ahead", [])))

    @property
    def tokenizer(self):
        """Rank 0's engine tokenizer (None elsewhere)."""
        return None if self.service is None else self.service.tokenizer

    def drain_ahead(self, step: int) -> float | None:
        """Rank 0, before step ``step``'s weight sync: the seconds its rollouts started ahead took to finish
        generating (:meth:`~megatron_tir.train.producer.Producer.drain_ahead`); None elsewhere or when none ran."""
        return None if self.producer is None else self.producer.drain_ahead(step)

    def evaluate(self, problems, observe=None) -> dict[str, float]:
        """Rank 0's held-out evaluation (:meth:`~megatron_tir.train.producer.Producer.evaluate`); {} elsewhere
        (every rank calls it inside a ``rank0_phase``) or without problems."""
        return {} if self.producer is None or not problems else self.producer.evaluate(problems, observe)

    def rank0_phase(self, key: str, fn, *, what: str) -> dict:
        """``fn()`` on rank 0 while every other rank waits for it through the hand-off (never inside a
        collective: a phase may take longer than the default group's timeout); its result on rank 0
        (elsewhere what rank 0 published). ``key`` is unique to the phase (step number included)."""
        return self._handoff.rank0_phase(key, fn, what=what)

    def forget(self, key: str) -> None:
        """Rank 0: drop a phase's key that every rank has read (they trained a step together since)."""
        if self.rank == 0:
            self._handoff.forget(key)

    def offload(self, step: int) -> None:
        """Before the update (collective): rank 0's engine frees its memory where it shares the trainer's
        devices (colocated SGLang; the local engine's no-op release), taken back by ``sync_weights``;
        the other ranks wait for it through the hand-off. Skipped while a later step's rollouts are in
        flight: they need the engine."""
        self.rank0_phase(f"offload/{step}", self.producer.release_engine if self.producer else lambda: None,
                         what=f"rank 0 to free the engine's memory (step {step})")
        self.forget(f"offload/{step - 2}")

    def sync_weights(self, learner, *, version: int | None = None) -> None:
        """The learner's weights into the engine (collective: every rank calls it), through the engine
        kind's weight sync (``megatron_tir.rollout.sync``); ``version``: the weight version the engine gets
        (a resumed run continues its numbering), default one more than its own."""
        if self.weights.wait_for_rank0:
            # the other ranks wait for rank 0 (which may first drain a step of rollouts: minutes) by
            # polling the store as long as rank 0 lives, not inside the sync's collectives (a group's timeout)
            key = f"sync/{self._syncs}"
            self._syncs += 1
            if self.rank == 0:
                self._handoff.publish(key, {})
                self._handoff.forget(f"sync/{self._syncs - 2}")  # every rank read it: they synced together since
            else:
                self._handoff.receive(key, what="rank 0 to start the weight sync")
        with self._engine_paused():
            if version is None:
                self.weights.update(learner)
            else:
                self.weights.update(learner, version=version)
        if self.producer is not None:  # full: the new version may admit more groups
            self.producer.poke()

    def _engine_paused(self):
        """Rank 0: the engine's idle-share clock stops while a sync holds it (``EngineActivity.paused``)."""
        activity = getattr(self.service, "activity", None)
        return activity.paused() if activity is not None else contextlib.nullcontext()

    def engine_busy_s(self) -> float:
        """Rank 0: seconds so far with a generation request in flight and no sync under way (0 elsewhere)."""
        return 0.0 if self.service is None else self.service.engine_busy_s()

    def close(self) -> None:
        self._handoff.close()
        if self.producer is not None:
            try:
                self.producer.stop()
            except Exception:  # noqa: BLE001 - closing after a failure: the service's close reports it
                log.exception("stopping the group producer")
        if getattr(self, "weights", None) is not None:
            self.weights.close()
            self.weights = None
        if self.service is not None:
            self.service.close()

    def __enter__(self) -> RolloutSource:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

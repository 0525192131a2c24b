"""The rollout source: rank 0 produces a step's rollouts, every rank consumes the rows it trains.

    source.submit(step)          # rank 0: the step's rollouts start on the event-loop thread
    got = source.next(step)      # every rank: this rank's share of the trained rows (or none)

Every rank calls both; which rank produces is hidden here. On rank 0 the
:class:`~megatron_tir.train.rollouts.RolloutService` (engine, sandbox, verifier) runs the
rollouts on its own event-loop thread, so the main thread is free while they run (asynchronous
training builds on ``submit`` / ``next``). ``next`` then, on rank 0: dynamic sampling's group
filter (per-row summaries, no ``[B, T]`` tensors), the row roles and advantages over every
counted row (:func:`~megatron_tir.train.batch.plan_update`), the rows no mode trains removed,
each data-parallel replica's share dealt (:func:`~megatron_tir.train.batch.deal_rows`), and the
hand-off (:class:`~megatron_tir.train.handoff.HandOff`: a header through the job's store, each TP
group's rows once, the other ranks waiting on rank 0's heartbeat rather than in a collective).
Every rank-0-only phase (held-out evaluation, the engine's offload) goes through the same
hand-off (:meth:`RolloutSource.rank0_phase`).

A step stops the run (:class:`TrainingStopped`, exit 1, nothing saved) when infrastructure
ended more than ``trainer.stop.infra_failure_share`` of its trajectories.

``trainer.async=full``: ``submit`` starts a :class:`~megatron_tir.train.group_producer.GroupProducer`
once (groups generated without a break under the staleness bound) and ``next`` takes the step's
groups from it; the prompt position a checkpoint records is then the first one not consumed, with
the consumed positions past it (``StepRollouts.data_consumed_ahead``).
"""

from __future__ import annotations

import contextlib
import concurrent.futures
import dataclasses
import functools
import logging
import time
from dataclasses import dataclass

from megatron_tir.openmp import release_idle_threads
from megatron_tir.rollout.factory import InfrastructureError, build_weight_sync
from megatron_tir.rollout.trajectory import INFRA_STATUSES
from megatron_tir.rollout.batch import weight_version_metrics
from megatron_tir.train.batch import Collected, TrainRows, collect_groups, deal_rows, plan_update, to_tensors
from megatron_tir.train.config import TrainConfig
from megatron_tir.train.data import PromptStream
from megatron_tir.train.group_producer import GroupProducer
from megatron_tir.train.handoff import HandOff, one_line
from megatron_tir.train.metrics import interruption_metrics, rollout_metrics
from megatron_tir.train.turn_schedule import schedule_due, switched

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
    collected: Collected | None  # rank 0: what dynamic sampling collected (observers read it); elsewhere None
    data_consumed_ahead: list[int] = dataclasses.field(default_factory=list)  # full: consumed positions past it

    @classmethod
    def of_groups(cls, groups, cfg: TrainConfig, *, pad_id: int = 0) -> StepRollouts:
        """A one-replica step of scored ``groups`` without a source (what ``next`` gives a rank when
        the data-parallel size is 1; for checks of the update alone)."""
        tc = cfg.trainer
        plan = plan_update(to_tensors(groups, pad_id=pad_id), mode=tc.mode,
                           advantage=None if tc.ppo.advantage == "gae" else tc.ppo.advantage,
                           overlong=tc.filters.overlong, mini_batches=tc.ppo.mini_batches)
        r = plan.rows
        return cls(rows=r if r.batch_size else None, mini_batches=int(r.mini_batch_B.max()) + 1 if r.batch_size else 0,
                   metrics={}, data_position=0, schedule_switched_at=None,
                   rollout_budget=(cfg.rollout.max_turns, cfg.rollout.max_response_tokens),
                   turns=int(r.turn_index_BT.max()) + 1 if r.batch_size else 0, collected=None)


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
        self._producer: GroupProducer | None = None
        self._handoff = HandOff(poll_s=poll_s, alive_timeout_s=alive_timeout_s)
        self.rank = self._handoff.rank
        self.service = None
        self._pending = {}
        self._lengths: list[float] = []  # mean response length per step, for the plateau rule (restarts on a resume)
        self.schedule_switched_at = schedule_switched_at
        self._rollout_cfg = cfg.rollout if schedule_switched_at is None else switched(cfg.rollout,
                                                                                       cfg.trainer.turn_schedule)
        self.stream = PromptStream(cfg.data, position=position, skip=consumed_ahead) if self.rank == 0 else None
        if self.rank == 0:
            try:
                self.service = service_factory()
            except BaseException as exc:
                self._handoff.publish("start", {"error": one_line(exc, 10_000)})
                self._handoff.close()
                raise
            self._handoff.publish("start", {"error": None})
            self._pad_id = pad_id if pad_id is not None else _pad_id(self.service.tokenizer)
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
        return self._rollout_cfg

    @property
    def received_bytes(self) -> int:
        return self._handoff.received_bytes

    def submit(self, step: int) -> None:
        """Start step ``step``'s rollouts (rank 0, on the event-loop thread; elsewhere nothing)."""
        if self.rank != 0:
            return
        tc = self.cfg.trainer
        if self.schedule_switched_at is None and schedule_due(step, tc.turn_schedule, self._lengths):
            self._rollout_cfg, self.schedule_switched_at = switched(self.cfg.rollout, tc.turn_schedule), step
            log.info("turn schedule: %d turns, %d tokens from step %d", self._rollout_cfg.max_turns,
                     self._rollout_cfg.max_response_tokens, step)
        if self.full:
            self._pending[step] = (time.perf_counter(), None)
            if self._producer is None:
                self._producer = GroupProducer(
                    arollout=self.service.arollout, stream=self.stream, rollout_cfg=lambda: self._rollout_cfg,
                    version=lambda: self.service.weight_version, batch=tc.sampling.prompts_per_step,
                    max_staleness=tc.asynchrony.max_staleness, filters=tc.filters,
                    max_groups=tc.sampling.max_rounds * tc.sampling.prompts_per_round)
                self.service.runner.run(self._producer.start())
            return
        one_round = functools.partial(self._sample_round, self._rollout_cfg)
        f = tc.filters
        coro = collect_groups(one_round, want=tc.sampling.prompts_per_step, max_rounds=tc.sampling.max_rounds,
                              drop_zero_std=f.drop_zero_std, accuracy_lo=f.accuracy_lo, accuracy_hi=f.accuracy_hi,
                              overlong=f.overlong, min_rows=f.min_group_rows, strategy=tc.sampling.strategy,
                              seed=tc.seed * 100003 + step)
        self._pending[step] = (time.perf_counter(), self.service.submit(coro))

    def submitted(self, step: int) -> bool:
        """Whether ``step``'s rollouts were submitted and not yet consumed (rank 0; True elsewhere: nothing to start)."""
        return self.rank != 0 or step in self._pending

    def drain(self, step: int) -> None:
        """Rank 0: wait until ``step``'s rollouts have finished generating (elsewhere nothing), so a
        weight sync after it never lands in the middle of them: each of their groups comes from one
        weight version (``trainer.async=one_step``). A failure is left to ``next(step)``, which tells
        every rank."""
        if self.rank == 0 and step in self._pending and self._pending[step][1] is not None:
            release_idle_threads()
            concurrent.futures.wait([self._pending[step][1]])

    async def _sample_round(self, rollout_cfg):
        start = self.stream.position  # group ids are positions in the prompt stream
        problems = self.stream.take(self.cfg.trainer.sampling.prompts_per_round)
        return await self.service.arollout(problems, rollout_cfg, group_id_offset=start,
                                           progress=self.cfg.trainer.progress)

    def next(self, step: int) -> StepRollouts:
        """This rank's share of step ``step``'s trained rows (blocks until rank 0 has them)."""
        key = f"step/{step}"
        if self.rank != 0:
            header, rows = self._handoff.receive(key, what=f"step {step}'s rollouts")
            return self._result(header, rows, {}, None)
        try:
            header, shares, metrics, got = self._produce(step)
        except BaseException as exc:  # the other ranks end with the cause instead of waiting for rank 0's exit
            self._handoff.publish(key, {"stop": f"rank 0 failed in step {step}'s rollouts: {one_line(exc)}"})
            raise
        rows = self._handoff.publish(key, header, shares)
        self._handoff.forget(f"step/{step - 2}")  # every rank has read it: they trained step - 1 together
        return self._result(header, rows, metrics, got)

    def _produce(self, step: int) -> tuple[dict, list[TrainRows] | None, dict, Collected]:
        t0, future = self._pending.pop(step)
        tc = self.cfg.trainer
        ahead, metrics = [], {}
        release_idle_threads()  # this thread waits for the engine's: its idle OpenMP team would slow them
        if future is not None:
            got = future.result()
            position = self.stream.position  # after the rounds: they draw prompts as they go
        else:  # full: the step's groups from the producer
            taken = self.service.runner.run(self._producer.take(tc.sampling.prompts_per_step))
            got, position, ahead = taken.collected, taken.data_position, taken.consumed_ahead
            metrics |= {"rollout/groups_in_flight": float(taken.in_flight)}
            if step == tc.steps:  # the last step: nothing more to generate (what runs returns to the stream)
                self.service.runner.run(self._producer.stop())
        metrics |= rollout_metrics(got.sampled) | interruption_metrics(got.groups)
        if stale := self.service.take_stale_responses():  # a server restarted with other weights
            metrics["rollout/stale_responses_dropped"] = float(stale)
            log.warning("step %d: %d answers from servers with stale weights dropped and retried", step, stale)
        metrics |= {f"filter/groups_{k}": float(v) for k, v in got.removed.items()}
        metrics |= {"filter/groups_kept": float(len(got.groups)), "filter/sample_rounds": float(got.rounds)}
        self._lengths.append(metrics.get("rollout/mean_response_tokens", 0.0))
        header = {"data_position": position, "consumed_ahead": ahead, "schedule_switched_at": self.schedule_switched_at,
                  "budget": [self._rollout_cfg.max_turns, self._rollout_cfg.max_response_tokens],
                  "mini_batches": 0, "turns": 0, "stop": _infra_stop(got.sampled, tc.stop.infra_failure_share)}
        shares = None
        if got.groups and header["stop"] is None:
            rt = to_tensors(got.groups, pad_id=self._pad_id)
            gae = tc.ppo.advantage == "gae"  # the critic's GAE fills the advantages in on every rank
            plan = plan_update(rt, mode=tc.mode, advantage=None if gae else tc.ppo.advantage,
                               overlong=tc.filters.overlong, mini_batches=tc.ppo.mini_batches)
            s = rt.rows
            metrics |= {"filter/rows": float(rt.tokens_BT.shape[0]), "filter/rows_void": float(s.void_B.sum()),
                        "filter/rows_infra": float(s.infra_B.sum()), "filter/rows_truncated": float(s.truncated_B.sum()),
                        "filter/rows_in_stats": float(plan.stats_B.sum()),
                        "filter/rows_in_loss": float(plan.trained_B.sum()),
                        "train/advantage_abs_mean": float(plan.advantages_B.abs().mean())}
            if plan.rows.batch_size:
                r = plan.rows
                shares = deal_rows(r, self._handoff.dp_size)
                header["mini_batches"] = int(r.mini_batch_B.max()) + 1
                header["turns"] = int(r.turn_index_BT.max()) + 1
                # the lag against the weights being trained (the engine's version is the learner's: a
                # sync follows every update): 0 in synchronous training, 1 with trainer.async=one_step
                metrics |= weight_version_metrics(plan.versions_BT, r.loss_mask_BT,
                                                  current=self.service.weight_version)
                metrics["train/tokens"] = float(r.attention_mask_BT.sum()) * tc.ppo.epochs
        metrics["time/rollout"] = time.perf_counter() - t0
        return header, shares, metrics, got

    def _result(self, header: dict, rows: TrainRows | None, metrics: dict, collected: Collected | None) -> StepRollouts:
        if header["stop"] is not None:
            raise TrainingStopped(header["stop"])
        self.schedule_switched_at = header["schedule_switched_at"]
        return StepRollouts(rows=rows, mini_batches=header["mini_batches"], metrics=metrics,
                            data_position=header["data_position"], schedule_switched_at=header["schedule_switched_at"],
                            rollout_budget=tuple(header["budget"]), turns=header["turns"], collected=collected,
                            data_consumed_ahead=list(header.get("consumed_ahead", [])))

    @property
    def tokenizer(self):
        """Rank 0's engine tokenizer (None elsewhere)."""
        return None if self.service is None else self.service.tokenizer

    def evaluate(self, problems, observe=None) -> dict[str, float]:
        """Held-out reward and TIR behaviour with the current weights (rank 0; {} elsewhere);
        ``observe(groups)`` sees the groups."""
        if self.rank != 0 or not problems:
            return {}
        cfg, rc = self.cfg, self._rollout_cfg
        T = cfg.data.eval_temperature if cfg.data.eval_temperature is not None else rc.temperature
        top_p = cfg.data.eval_top_p if cfg.data.eval_top_p is not None else rc.top_p
        ecfg = dataclasses.replace(rc, n_samples=cfg.data.eval_samples, temperature=T, top_p=top_p,
                                   seed=cfg.trainer.seed + 1)
        t0 = time.perf_counter()
        release_idle_threads()
        if self._producer is not None:  # full: the evaluation first, then generation ahead again
            self.service.runner.run(self._producer.hold(True))
        try:
            groups = self.service.rollout(problems, ecfg, group_id_offset=0, progress=cfg.trainer.progress,
                                          desc="eval")
        finally:
            if self._producer is not None:
                self.service.runner.run(self._producer.hold(False))
        if observe is not None:
            observe(groups)
        return rollout_metrics(groups, prefix="eval") | {"time/eval": time.perf_counter() - t0}

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
        def release() -> None:
            if not self._pending and self._producer is None:
                self.service.offload()
        self.rank0_phase(f"offload/{step}", release, what=f"rank 0 to free the engine's memory (step {step})")
        self.forget(f"offload/{step - 2}")

    def sync_weights(self, learner) -> None:
        """The learner's weights into the engine (collective: every rank calls it), through the engine
        kind's weight sync (``megatron_tir.rollout.sync``)."""
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
            self.weights.update(learner)
        if self._producer is not None:  # full: the new version may admit more groups
            self.service.runner.run(self._producer.poke())

    def _engine_paused(self):
        """Rank 0: the engine's idle-share clock stops while a sync holds it (``EngineActivity.paused``)."""
        activity = getattr(self.service, "activity", None)
        return activity.paused() if activity is not None else contextlib.nullcontext()

    def engine_busy_s(self) -> float:
        """Rank 0: seconds so far with a generation request in flight and no sync under way (0 elsewhere)."""
        return 0.0 if self.service is None else self.service.engine_busy_s()

    def close(self) -> None:
        self._handoff.close()
        if self._producer is not None:
            try:
                self.service.runner.run(self._producer.stop())
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


def _infra_stop(groups, max_share: float) -> str | None:
    """The cause when infrastructure ended more than ``max_share`` of the trajectories, else None."""
    trajs = [t for g in groups for t in g.trajectories]
    failed = [t for t in trajs if t.status in INFRA_STATUSES]
    if not trajs or len(failed) <= max_share * len(trajs):
        return None
    first = ""
    if failed[0].turns and failed[0].turns[-1].tool is not None:
        first = failed[0].turns[-1].tool.result.message or failed[0].turns[-1].tool.status.value
    return (f"{len(failed)} of {len(trajs)} trajectories of the step were ended by infrastructure failures "
            f"(more than trainer.stop.infra_failure_share={max_share:g}); stopping before the update"
            + (f" (first: {' '.join(first.split())[:200]})" if first else ""))


def _pad_id(tokenizer) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    assert pad is not None, "the tokenizer has neither a pad nor an EOS token"
    return int(pad)

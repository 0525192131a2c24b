"""Rank 0's production of a step's rollouts: the prompt stream, the turn schedule, dynamic sampling,
and each step's trained rows (row roles, group advantages, each data-parallel replica's share) with
the step's rollout and filter metrics. The hand-off (``train/handoff.py``, ``HandOff.take``) deals
them to the other ranks.

One strategy per ``trainer.async`` mode, chosen once:

* :class:`Rounds` (``off``, ``one_step``): a step's rounds of dynamic sampling
  (:func:`~megatron_tir.train.sampling.collect_groups`) run on the service's event loop as one future;
  with ``one_step`` it runs ahead: step + 1's start as soon as step's are taken (:meth:`Producer.take`)
  and finish generating before the step's weight sync (:meth:`Producer.drain_ahead`);
* :class:`Continuous` (``full``): a :class:`~megatron_tir.train.group_producer.GroupProducer`
  generates groups without a break under the staleness bound and each step takes its batch; the
  prompt position a checkpoint records is then the first one not consumed, with the consumed
  positions past it.

A new mode is one strategy class (``submit``, ``take``, ``hold``, ``poke``, ``stop``).
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import time
from dataclasses import dataclass

import torch

from megatron_tir.eval.held_out import run_held_out
from megatron_tir.rl import needs_values
from megatron_tir.rollout.batch import RowFate, collate, flatten, weight_version_metrics
from megatron_tir.rollout.trajectory import INFRA_STATUSES
from megatron_tir.train.batch import TrainRows, UpdatePlan, deal_rows, plan_update
from megatron_tir.train.config import TrainConfig
from megatron_tir.train.critic_update import warmup_unfiltered
from megatron_tir.train.data import PromptStream
from megatron_tir.train.group_producer import GroupProducer
from megatron_tir.train.metrics import interruption_metrics, rollout_metrics
from megatron_tir.train.row_filter import eval_filter_rules
from megatron_tir.train.sampling import Collected, collect_groups
from megatron_tir.train.turn_schedule import schedule_due, switched

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class Produced:
    """Rank 0's step: the hand-off header, each replica's rows (None: none trained), the metrics, the groups
    and what the step decided for each sampled row (:func:`row_fates`)."""
    header: dict
    shares: list[TrainRows] | None
    metrics: dict
    collected: Collected
    fates: dict[tuple[int, int], RowFate]


class Rounds:
    """``off`` / ``one_step``: each step's rounds of dynamic sampling as one future on the event loop."""

    def __init__(self, producer: Producer) -> None:
        self.p = producer
        self.ahead = producer.cfg.trainer.asynchrony.mode == "one_step"  # step + 1's rounds start at step's take

    def submit(self, step: int) -> concurrent.futures.Future:
        p, tc = self.p, self.p.cfg.trainer
        f = tc.filters
        off = p.warmup_unfiltered(step)  # a critic-only warm-up step with critic.filter_in_warmup=false
        coro = collect_groups(functools.partial(self._sample_round, p.rollout_cfg), want=tc.sampling.prompts_per_step,
                              max_rounds=tc.sampling.max_rounds, drop_zero_std=f.drop_zero_std and not off,
                              accuracy_lo=0.0 if off else f.accuracy_lo, accuracy_hi=1.0 if off else f.accuracy_hi,
                              overlong=f.overlong,
                              min_rows=f.min_group_rows, strategy=tc.sampling.strategy, seed=tc.seed * 100003 + step)
        return p.service.submit(coro)

    async def _sample_round(self, rollout_cfg):
        p = self.p
        start = p.stream.position  # group ids are positions in the prompt stream
        problems = p.stream.take(p.cfg.trainer.sampling.prompts_per_round)
        return await p.service.arollout(problems, rollout_cfg, group_id_offset=start, progress=p.cfg.trainer.progress)

    def take(self, step: int, future) -> tuple[Collected, int, list[int], dict]:
        return future.result(), self.p.stream.position, [], {}  # the position after the rounds: they draw as they go

    def hold(self, on: bool) -> None:
        pass

    @property
    def running(self) -> bool:
        return False

    def poke(self) -> None:
        pass

    def stop(self) -> None:
        pass


class Continuous:
    """``full``: one group producer, started at the first step, generating without a break."""

    ahead = False  # it never stops: nothing to start ahead

    def __init__(self, producer: Producer) -> None:
        self.p = producer
        self.groups: GroupProducer | None = None

    def submit(self, step: int) -> None:
        p, tc = self.p, self.p.cfg.trainer
        if self.groups is None:
            self.groups = GroupProducer(
                arollout=p.service.arollout, stream=p.stream, rollout_cfg=lambda: p.rollout_cfg,
                version=lambda: p.service.weight_version, batch=tc.sampling.prompts_per_step,
                max_staleness=tc.asynchrony.max_staleness, filters=tc.filters,
                max_groups=tc.sampling.max_rounds * tc.sampling.prompts_per_round,
                unfiltered=p.warmup_unfiltered, first_step=step)  # critic.filter_in_warmup, as Rounds
            p.service.runner.run(self.groups.start())
        return None

    def take(self, step: int, future) -> tuple[Collected, int, list[int], dict]:
        p, tc = self.p, self.p.cfg.trainer
        taken = p.service.runner.run(self.groups.take(tc.sampling.prompts_per_step))
        if step == tc.steps:  # the last step: nothing more to generate (what runs returns to the stream)
            p.service.runner.run(self.groups.stop())
        return (taken.collected, taken.data_position, list(taken.consumed_ahead),
                {"rollout/groups_in_flight": float(taken.in_flight)})

    def hold(self, on: bool) -> None:
        """The held-out evaluation first, then generation ahead again."""
        if self.groups is not None:
            self.p.service.runner.run(self.groups.hold(on))

    @property
    def running(self) -> bool:
        return self.groups is not None

    def stop(self) -> None:
        if self.groups is not None:
            self.p.service.runner.run(self.groups.stop())

    def poke(self) -> None:
        """After a weight sync: the new version may admit more groups."""
        if self.groups is not None:
            self.p.service.runner.run(self.groups.poke())


STRATEGIES = {"off": Rounds, "one_step": Rounds, "full": Continuous}


class Producer:
    """Rank 0 only: owns the prompt stream and the turn schedule; ``submit`` / ``drain`` / ``produce``."""

    def __init__(self, cfg: TrainConfig, service, *, position: int, consumed_ahead, schedule_switched_at: int | None,
                 pad_id: int | None, dp_size: int) -> None:
        self.cfg, self.service, self.dp_size = cfg, service, dp_size
        self.stream = PromptStream(cfg.data, position=position, skip=consumed_ahead)
        self.schedule_switched_at = schedule_switched_at
        self.rollout_cfg = cfg.rollout if schedule_switched_at is None else switched(cfg.rollout,
                                                                                     cfg.trainer.turn_schedule)
        self._lengths: list[float] = []  # mean response length per step, for the plateau rule (restarts on a resume)
        self._pending: dict[int, tuple[float, concurrent.futures.Future | None]] = {}
        self.pad_id = pad_id if pad_id is not None else _pad_id(service.tokenizer)
        self.strategy = STRATEGIES[cfg.trainer.asynchrony.mode](self)

    def submit(self, step: int) -> None:
        """Start step ``step``'s rollouts (the turn schedule may switch the budgets from this step)."""
        tc = self.cfg.trainer
        if self.schedule_switched_at is None and schedule_due(step, tc.turn_schedule, self._lengths):
            self.rollout_cfg, self.schedule_switched_at = switched(self.cfg.rollout, tc.turn_schedule), step
            log.info("turn schedule: %d turns, %d tokens from step %d", self.rollout_cfg.max_turns,
                     self.rollout_cfg.max_response_tokens, step)
        t0 = time.perf_counter()  # the step's rollout clock starts before the strategy's start-up
        self._pending[step] = (t0, self.strategy.submit(step))

    def submitted(self, step: int) -> bool:
        return step in self._pending

    @property
    def idle(self) -> bool:
        """No rollouts in flight or running ahead (the engine may free its memory)."""
        return not self._pending and not self.strategy.running

    def drain(self, step: int) -> None:
        """Wait until ``step``'s rollouts have finished generating (a failure is left to ``produce``)."""
        if step in self._pending and self._pending[step][1] is not None:
            self.service.waiting()
            concurrent.futures.wait([self._pending[step][1]])

    def take(self, step: int) -> Produced:
        """Step ``step``'s rollouts (started now unless they already run: :meth:`produce`); where the strategy
        runs ahead (``one_step``) step + 1's start as soon as these are taken: they run while this step
        trains, with the weights it trains from (one version stale)."""
        if not self.submitted(step):
            self.submit(step)
        produced = self.produce(step)
        if self._ahead(step):
            self.submit(step + 1)
        return produced

    def drain_ahead(self, step: int) -> float | None:
        """Before step ``step``'s weight sync: the seconds spent waiting for the rollouts started ahead of it
        to finish generating (each group comes from one weight version); None when none run ahead."""
        if not self._ahead(step):
            return None
        t0 = time.perf_counter()
        self.drain(step + 1)
        return time.perf_counter() - t0

    def _ahead(self, step: int) -> bool:
        return self.strategy.ahead and step < self.cfg.trainer.steps

    def release_engine(self) -> None:
        """Before an update: the engine frees its memory where it shares the trainer's devices, unless
        rollouts are in flight or run ahead (they need it)."""
        if self.idle:
            self.service.offload()

    def evaluate(self, problems, observe=None) -> dict[str, float]:
        """Held-out reward and TIR behaviour with the current weights (:func:`megatron_tir.eval.held_out.run_held_out`;
        ``full`` holds its admission meanwhile); ``observe(groups, metrics)`` sees the groups and their metrics."""
        groups, seconds = run_held_out(self.service, self.cfg, self.rollout_cfg, problems, hold=self.strategy.hold)
        metrics = rollout_metrics(groups, prefix="eval") | {"time/eval": seconds}
        if observe is not None:
            observe(groups, metrics)
        return metrics

    def produce(self, step: int) -> Produced:
        """Step ``step``'s groups, metrics, hand-off header and each replica's trained rows."""
        t0, future = self._pending.pop(step)
        tc = self.cfg.trainer
        self.service.waiting()  # this thread waits for the engine's work (the local engine: its idle OpenMP team back)
        got, position, ahead, metrics = self.strategy.take(step, future)
        metrics |= rollout_metrics(got.sampled) | interruption_metrics(got.groups)
        if stale := self.service.take_stale_responses():  # a server restarted with other weights
            metrics["rollout/stale_responses_dropped"] = float(stale)
            log.warning("step %d: %d answers from servers with stale weights dropped and retried", step, stale)
        metrics |= {f"filter/groups_{k}": float(v) for k, v in got.removed.items()}
        metrics |= {"filter/groups_kept": float(len(got.groups)), "filter/sample_rounds": float(got.rounds)}
        self._lengths.append(metrics.get("rollout/mean_response_tokens", 0.0))
        header = {"data_position": position, "consumed_ahead": ahead, "schedule_switched_at": self.schedule_switched_at,
                  "budget": [self.rollout_cfg.max_turns, self.rollout_cfg.max_response_tokens],
                  "mini_batches": 0, "turns": 0,
                  # a dead sandbox broker stops the run with its one line (ClusterSandbox.unavailable)
                  "stop": _infra_stop(got.sampled, tc.stop.infra_failure_share)
                  or getattr(getattr(self.service, "sandbox", None), "unavailable", None)}
        shares, plan, row_rules = None, None, None
        if got.groups and header["stop"] is None:
            shares, plan, row_rules = self._rows(got, header, metrics, step)
        metrics["time/rollout"] = time.perf_counter() - t0
        return Produced(header=header, shares=shares, metrics=metrics, collected=got,
                        fates=row_fates(got, plan, row_rules))

    def warmup_unfiltered(self, step: int) -> bool:
        """Whether step ``step`` samples and trains without the group and row filters (critic warm-up)."""
        return warmup_unfiltered(self.cfg.critic, uses_critic=needs_values(self.cfg.trainer.ppo.advantage), step=step)

    def _rows(self, got: Collected, header: dict, metrics: dict,
              step: int = 0) -> tuple[list[TrainRows] | None, UpdatePlan, list[str | None] | None]:
        """Row roles and group advantages over every counted row, the rows some token of which is trained,
        dealt to the replicas (None: no row is trained), the plan that decided them and the eval filter's
        rule of each row (None: the filter is off)."""
        tc = self.cfg.trainer
        rb = collate(got.groups, pad_id=self.pad_id)
        per_token = needs_values(tc.ppo.advantage)  # the critic's GAE fills the advantages in on every rank
        rules = None if self.warmup_unfiltered(step) else eval_filter_rules(
            flatten(got.groups), max_repeat_score=tc.filters.max_repeat_score,
            drop_verifier_failures=tc.filters.drop_verifier_failures)
        excluded = None if rules is None else torch.tensor([r is not None for r in rules], dtype=torch.bool)
        if excluded is not None:
            metrics["filter/rows_eval_filtered"] = float(excluded.sum())
        plan = plan_update(rb, mode=tc.mode, advantage=None if per_token else tc.ppo.advantage,
                           overlong=tc.filters.overlong, mini_batches=tc.ppo.mini_batches, excluded_B=excluded)
        s = rb.rows
        metrics |= {"filter/rows": float(rb.tokens_BT.shape[0]), "filter/rows_void": float(s.void_B.sum()),
                    "filter/rows_infra": float(s.infra_B.sum()), "filter/rows_truncated": float(s.truncated_B.sum()),
                    "filter/rows_prompt_too_long": float(s.data_error_B.sum()),
                    "filter/rows_in_stats": float(plan.stats_B.sum()),
                    "filter/rows_in_loss": float(plan.trained_B.sum()),
                    "train/advantage_abs_mean": float(plan.advantages_B.abs().mean())}
        if not plan.rows.batch_size:
            return None, plan, rules
        r = plan.rows
        header["mini_batches"] = int(r.mini_batch_B.max()) + 1
        header["turns"] = int(r.turn_index_BT.max()) + 1
        # the lag against the weights being trained (the engine's version is the learner's: a sync follows
        # every update): 0 in synchronous training, 1 with trainer.async=one_step
        metrics |= weight_version_metrics(plan.versions_BT, r.loss_mask_BT, current=self.service.weight_version)
        metrics["train/tokens"] = float(r.attention_mask_BT.sum()) * tc.ppo.epochs
        return deal_rows(r, self.dp_size), plan, rules

    def poke(self) -> None:
        """After a weight sync (the strategy's: ``full`` may admit more groups)."""
        self.strategy.poke()

    def stop(self) -> None:
        self.strategy.stop()


def row_fates(got: Collected, plan: UpdatePlan | None,
              row_rules: list[str | None] | None = None) -> dict[tuple[int, int], RowFate]:
    """``(group_id, sample_index) ->`` what the step decided for each sampled row: the rule dynamic sampling
    recorded for a group left out of the batch (``Collected.rules``), the plan's row roles and advantages
    for the batch's rows (``plan`` of ``got.groups``; None: no batch) and the eval filter's rule of each
    (``row_rules``, in the batch's order). A critic's GAE records no advantage."""
    out = {}
    for g in got.sampled:
        if (rule := got.rules.get(g.group_id)) is not None:
            out |= {(t.group_id, t.sample_index): RowFate(in_stats=False, in_loss=False, advantage=None,
                                                          group_rule=rule) for t in g.trajectories}
    if plan is not None:
        for b, t in enumerate(t for g in got.groups for t in g.trajectories):
            out[(t.group_id, t.sample_index)] = RowFate(
                in_stats=bool(plan.stats_B[b]), in_loss=bool(plan.trained_B[b]),
                advantage=float(plan.advantages_B[b]) if plan.estimated else None,
                row_rule=None if row_rules is None else row_rules[b])
    return out


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

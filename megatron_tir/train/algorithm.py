"""What the trainer optimises: one ``Algorithm`` per advantage family.

    algorithm = build_algorithm(cfg, policy)          # the family of trainer.ppo.advantage
    stats = algorithm.update(step, got, timings)      # prepare -> steps over mini-batches -> finish

* :class:`PolicyGradient` -- estimators computed per group on rank 0 before the hand-off
  (GRPO, Dr. GRPO, Reinforce++: ``megatron_tir.rl.ADVANTAGE_ESTIMATORS``); the rows arrive with
  their advantages.
* :class:`CriticPPO` -- estimators computed per token from a critic's values on every rank
  (GAE: ``megatron_tir.rl.CRITIC_ESTIMATORS``, ``megatron_tir.train.critic_update``): a second
  learner with a value head, a value pass before the update, a critic step before each policy
  step (only the critic's step in its first ``critic.warmup_steps`` steps).

Both take the same three phases:

1. ``prepare(step, got)`` -- old log-probs (the learner's, or the engine's with
   ``trainer.ppo.old_logprobs=engine``), the frozen reference's (KL term), the family's values, and
   on the stage that computes the loss the mode's token filter, the family's advantages and the
   rollout correction (``trainer.correction``, :mod:`megatron_tir.rl.correction`: the engine's log-probs
   against the learner's recompute, in every ``trainer.async`` mode; its metrics every step);
2. ``steps(mb)`` for every mini-batch of every epoch (every rank of the world takes the same
   number of optimizer steps);
3. ``finish()`` -- a :class:`StepStats`: the train metrics of every replica's rows on every rank,
   whether anything learned, and what was not finite.

A pipeline stage holds what it reads of the rows (``megatron_tir.train.batch.stage_fields``): the
loss inputs are prepared on the last stage only, the forward passes run on every stage.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from megatron_tir.observe.probe import TurnProbe
from megatron_tir.policy.checkpoint.layout import CRITIC, POLICY
from megatron_tir.policy.losses import TokenLoss
from megatron_tir.policy.parallel import collective_device
from megatron_tir.policy.routing import update_routing
from megatron_tir.rl import MODES, PolicyLoss, needs_values
from megatron_tir.rl.correction import ASYNC_ALIASES, DEPRECATED_DEFAULTS, correct, named_stats
from megatron_tir.train.batch import Update, build_update, mini_batches, stage_update
from megatron_tir.train.config import TrainConfig
from megatron_tir.train.loss_scale import add_loss_scales
from megatron_tir.train.critic_update import critic_metrics, critic_step, gae_advantages
from megatron_tir.train.row_stats import RowStats, reduce_over_replicas

log = logging.getLogger(__name__)


@contextmanager
def timed(timings: dict, name: str):
    t0 = time.perf_counter()
    yield
    timings[f"time/{name}"] = time.perf_counter() - t0


@dataclass(kw_only=True, slots=True)
class StepStats:
    """What an update did (the same on every rank)."""
    metrics: dict[str, float] = field(default_factory=dict)
    updated: bool = False  # an optimizer step of the policy (of the critic, during its warm-up) was taken
    skipped: int = 0  # optimizer steps skipped for non-finite gradients
    nonfinite_weights: int = 0  # optimizer steps after which the weights were not finite


class PolicyGradient:
    """The policy alone: advantages come with the rows (computed on rank 0 before the hand-off)."""

    def __init__(self, cfg: TrainConfig, policy, *, reference=None) -> None:
        self.cfg, self.policy, self.reference = cfg, policy, reference
        tc = cfg.trainer
        self.temperature = cfg.rollout.temperature or 1.0
        self.high_ratio_bound = tc.filters.high_ratio_bound if MODES[tc.mode].high_ratio_filter else None
        self._step_state = None
        a = tc.asynchrony  # its correction / cap: the deprecated spelling of trainer.correction (what auto is)
        self.correction = tc.correction.resolved(a.mode, a.correction, a.cap)  # megatron_tir.rl.correction
        if a.mode != "off" and self.correction.mode == "none":
            log.warning("trainer.async=%s with no rollout correction: the stale tokens get no importance weight "
                        "(trainer.correction.mode=tis is the decoupled objective's)", a.mode)
        if (a.correction, a.cap) != DEPRECATED_DEFAULTS:
            log.warning("trainer.async.correction / trainer.async.cap are deprecated: read as trainer.correction."
                        "mode=%s high=%g low=0", ASYNC_ALIASES[a.correction], a.cap)
        self.routing = update_routing(policy, tc.ppo.routing_replay)  # MoE: None on a dense policy

    @property
    def learners(self) -> dict:
        """The learners a run checkpoint holds, by their name in it."""
        return {POLICY: self.policy}

    # ------------------------------------------------------------------ the three phases

    def prepare(self, step: int, got, timings: dict) -> Update:
        """Old log-probs, reference, values; this stage's update batch; the step's loss function."""
        tc, rows = self.cfg.trainer, got.rows
        with timed(timings, "logprobs"), _phase_bar(tc.progress, "log-probs", None, unit="micro-batch") as bar:
            tick = lambda: bar.update(1)  # noqa: E731
            if tc.ppo.old_logprobs == "learner":  # None past the last stage (which alone reads them)
                old_BT = self.policy.logprobs(rows.tokens_BT, rows.attention_mask_BT, temperature=self.temperature,
                                              local_rows=True, tick=tick)
            else:
                old_BT = rows.engine_logprobs_BT
            ref_BT = None if self.reference is None else self.reference.logprobs(
                rows.tokens_BT, rows.attention_mask_BT, temperature=self.temperature, local_rows=True, tick=tick)
        if self.routing is not None:  # after the old pass: the routing its rows replay (or compare with)
            self.routing.start(old_pass=tc.ppo.old_logprobs == "learner",
                               rollout_BTX=rows.routed_experts_BTX)  # the engine's (routing_replay=rollout)
        values_BT = self._values(rows, timings)
        stats = None
        if rows.loss_mask_BT is not None:  # this stage computes the loss
            update, stats = self._loss_batch(rows, old_BT, ref_BT, values_BT)
            add_loss_scales(update, rows.loss_mask_BT, tc.loss, mini_batches=tc.ppo.mini_batches, local_rows=True)
        else:
            update = stage_update(rows)
        loss_fn = TurnProbe(PolicyLoss(tc.loss, high_ratio_bound=self.high_ratio_bound), n_turns=got.turns)
        self._step_state = _StepState(step=step, stats=reduce_over_replicas(stats),  # every replica's rows, every rank
                                      loss_fn=loss_fn, token_loss=TokenLoss(token_loss=loss_fn,
                                                                            temperature=self.temperature,
                                                                            with_entropy=True))  # entropy: a diagnostic
        return update

    def steps(self, mb) -> None:
        """One mini-batch: the policy's optimizer step."""
        s = self._step_state
        s.results.append(self.policy.train_step(mb, s.token_loss, aggregation=self.cfg.trainer.loss.learner_aggregation,
                                                local_rows=True))

    def finish(self) -> StepStats:
        s, self._step_state = self._step_state, None
        max_ratio = s.loss_fn.loss_fn.max_ratio_tensor  # on the loss's device: the group's backend needs it there
        if max_ratio is None:
            max_ratio = torch.zeros((), device=collective_device())
        torch.distributed.all_reduce(max_ratio, op=torch.distributed.ReduceOp.MAX)
        results = s.results
        metrics = {
            "filter/low_prob_tokens_masked": s.stats.totals.get("filter/low_prob_tokens_masked", 0.0),
            "train/optimizer_steps": float(len(results)),
            "train/skipped_steps": float(sum(r.skipped for r in results)),
            "train/empty_steps": float(sum(r.empty for r in results)),  # every loss token masked: no step taken
            "train/nonfinite_weights": float(sum(not r.weights_finite for r in results)),
            "train/max_ratio": float(max_ratio),
        } | self._family_metrics(s) | _offpolicy_metrics(s.stats) | (self.routing.finish() if self.routing else {})
        trained = [r for r in results if not r.empty]  # the same on every rank (warm-up and the empty steps are)
        if trained:
            metrics |= {"train/loss": sum(r.loss for r in trained) / len(trained),
                        "train/grad_norm": sum(r.grad_norm for r in trained) / len(trained),
                        "train/padding_share": sum(r.padding_share for r in trained) / len(trained)}
            means = {key: sum(r.metrics[key] for r in trained) / len(trained) for key in trained[0].metrics}
            metrics |= {f"train/{k}": v for k, v in s.loss_fn.finish(means).items()}
        skipped = sum(r.skipped for r in results)
        return StepStats(metrics=metrics, updated=len(results) > skipped or self._family_learned(metrics),
                         skipped=skipped, nonfinite_weights=sum(not r.weights_finite for r in results))

    def update(self, step: int, got, timings: dict) -> StepStats:
        """``prepare``, ``steps`` over ``trainer.ppo.epochs`` passes of the mini-batches, ``finish``."""
        tc = self.cfg.trainer
        if got.rows is None:
            log.warning("no group passed the filters; no update")
            return StepStats(metrics={"train/skipped_empty_batch": 1.0})
        update = self.prepare(step, got, timings)
        with timed(timings, "train"), _phase_bar(tc.progress, "update", tc.ppo.epochs * got.mini_batches) as bar:
            for _ in range(tc.ppo.epochs):
                for k, mb in enumerate(mini_batches(update, got.mini_batches)):
                    with self.routing.mini_batch(update.mini_batch_B == k) if self.routing else nullcontext():
                        self.steps(mb)  # an MoE policy's update routes mini-batch k's rows as recorded
                    bar.update(1)
        return self.finish()

    # ------------------------------------------------------------------ what a family adds

    def _values(self, rows, timings: dict):
        return None

    def _advantages(self, update: Update, rows, old_BT, ref_BT, values_BT) -> RowStats | None:
        return None

    def _family_metrics(self, s) -> dict[str, float]:
        return {}

    def _family_learned(self, metrics: dict) -> bool:
        return False

    def _loss_batch(self, rows, old_BT, ref_BT, values_BT) -> tuple[Update, RowStats]:
        """The update of the stage that computes the loss: the mode's token filter, the family's
        advantages, the off-policy correction; the sums of their metrics over this replica's rows."""
        tc = self.cfg.trainer
        update = build_update(rows, old_BT, mode=tc.mode, low_prob_fraction=tc.filters.low_prob_fraction,
                              ref_logprobs_BT=ref_BT)
        stats = RowStats(totals={"filter/low_prob_tokens_masked": float(update.low_prob_masked)})
        if (family_stats := self._advantages(update, rows, old_BT, ref_BT, values_BT)) is not None:
            stats = stats.merge(family_stats)
        if tc.ppo.old_logprobs == "learner":  # the learner's recompute against the engine's: the gap (async: staleness too)
            c = correct(old_BT, rows.engine_logprobs_BT, update.batch.loss_mask_BT, self.correction,
                        turn_index_BT=rows.turn_index_BT, local_rows=True)
            update.batch = dataclasses.replace(update.batch, loss_mask_BT=c.loss_mask_BT,
                                               extras=update.batch.extras | c.extras())
            means, maxima = named_stats(c, legacy=tc.asynchrony.mode != "off")
            stats = stats.merge(RowStats(means=means, maxima=maxima))
        return update, stats


class CriticPPO(PolicyGradient):
    """PPO with a masked critic (ZeroTIR): GAE advantages from the critic's values on every rank, a
    critic step before each policy step, the critic alone during its warm-up."""

    def __init__(self, cfg: TrainConfig, policy, *, critic, reference=None) -> None:
        super().__init__(cfg, policy, reference=reference)
        self.critic = critic

    @property
    def learners(self) -> dict:
        return {POLICY: self.policy, CRITIC: self.critic}

    def prepare(self, step: int, got, timings: dict) -> Update:
        update = super().prepare(step, got, timings)
        self._step_state.warmup = step <= self.cfg.critic.warmup_steps
        return update

    def steps(self, mb) -> None:
        s = self._step_state
        s.critic_steps.append(critic_step(self.critic, mb, self.cfg.critic, self.cfg.trainer.loss.aggregation,
                                          local_rows=True))
        if not s.warmup:
            super().steps(mb)

    def _values(self, rows, timings: dict):
        with timed(timings, "values"):
            return self.critic.values(rows.tokens_BT, rows.attention_mask_BT, local_rows=True)

    def _advantages(self, update: Update, rows, old_BT, ref_BT, values_BT) -> RowStats:
        update.batch, stats = gae_advantages(update.batch, rows.rewards_B, values_BT, self.cfg.critic,
                                             model_mask_BT=rows.loss_mask_BT, behaviour_BT=old_BT,
                                             ref_BT=ref_BT, local_rows=True)
        return stats

    def _family_metrics(self, s) -> dict[str, float]:
        metrics = critic_metrics(s.stats)
        if s.critic_steps:
            metrics["critic/warmup"] = float(s.warmup)
            metrics["critic/empty_steps"] = sum(c["critic/empty"] for c in s.critic_steps)
            if stepped := [c for c in s.critic_steps if not c["critic/empty"]]:  # empty steps would pull means to 0
                metrics |= {k: sum(c[k] for c in stepped) / len(stepped) for k in stepped[0] if k != "critic/empty"}
        return metrics

    def _family_learned(self, metrics: dict) -> bool:  # the critic learned during its warm-up
        return metrics.get("critic/warmup") == 1.0 and metrics.get("critic/skipped", 1.0) < 1.0


@dataclass(kw_only=True, slots=True)
class _StepState:
    """One update's working state between ``prepare`` and ``finish``."""
    step: int
    stats: RowStats
    loss_fn: TurnProbe
    token_loss: TokenLoss
    results: list = field(default_factory=list)
    critic_steps: list = field(default_factory=list)
    warmup: bool = False


def _offpolicy_metrics(stats: RowStats) -> dict[str, float]:
    """The rollout correction's metrics (``correction/*``; in the async modes also the deprecated ``offpolicy/*``)."""
    prefixes = ("correction/", "offpolicy/")
    out = {k: stats.mean(k) for k in stats.means if k.startswith(prefixes) and stats.count(k)}
    return out | {k: v for k, v in stats.maxima.items() if k.startswith(prefixes)}


ALGORITHMS: dict[str, type[PolicyGradient]] = {"policy_gradient": PolicyGradient, "critic_ppo": CriticPPO}


def algorithm_class(cfg: TrainConfig) -> type[PolicyGradient]:
    """The class ``trainer.ppo.algorithm`` names (auto: the estimator's family; a ``module:Class`` import
    path: a subclass of :class:`PolicyGradient` of your own). One-line ValueError otherwise."""
    from megatron_tir.import_path import load_object

    name = cfg.trainer.ppo.algorithm
    if name == "auto":
        return CriticPPO if needs_values(cfg.trainer.ppo.advantage) else PolicyGradient
    cls = ALGORITHMS.get(name) or load_object(name, "trainer.ppo.algorithm")
    if not (isinstance(cls, type) and issubclass(cls, PolicyGradient)):
        raise ValueError(f"trainer.ppo.algorithm: {name} is not a subclass of megatron_tir.train.algorithm.PolicyGradient")
    if issubclass(cls, CriticPPO) != needs_values(cfg.trainer.ppo.advantage):
        raise ValueError(f"trainer.ppo.algorithm={name} does not match trainer.ppo.advantage="
                         f"{cfg.trainer.ppo.advantage} (a critic's estimators need critic_ppo, the others need none)")
    return cls


def build_algorithm(cfg: TrainConfig, policy, *, reference=None, critic=None) -> PolicyGradient:
    """The algorithm ``trainer.ppo.algorithm`` names, on ``policy``. ``reference`` / ``critic``: learners built by
    the caller (``None``: built here when the config needs them -- a frozen reference for a KL term, a value
    learner for an estimator that needs values)."""
    from megatron_tir.policy.learner import Learner

    cls = algorithm_class(cfg)
    if reference is None and (cfg.trainer.loss.kl_coef > 0 or cfg.critic.kl_reward_coef > 0):
        reference = Learner(cfg.learner, frozen=True)  # the initial policy, frozen
    if not issubclass(cls, CriticPPO):
        return cls(cfg, policy, reference=reference)
    if critic is None:  # same layout, a value head, its own optimizer
        critic = Learner(dataclasses.replace(cfg.learner, head="value", lr=cfg.critic.lr, min_lr=0.0, warmup_steps=0,
                                             lr_decay_style="constant", lr_decay_steps=None,
                                             model=cfg.critic.model or cfg.learner.model))
    return cls(cfg, policy, critic=critic, reference=reference)


def _phase_bar(progress: bool, desc: str, total: int | None, *, unit: str = "step"):
    """Rank 0's progress through a learner phase (micro-batches, optimizer steps): a bar on a terminal, a
    heartbeat line in the log file otherwise (``megatron_tir.observe.heartbeat``); nothing elsewhere."""
    from megatron_tir.observe.heartbeat import phase_progress

    if progress and torch.distributed.get_rank() == 0:
        return phase_progress(desc, total, unit=unit)
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, leave=False, disable=True)

"""The GRPO training loop for multi-turn TIR, top to bottom. Every trainer rank runs ``train``.

    rollouts (rank 0 behind the rollout source: engine, sandbox, rewards, group filter, row roles,
    advantages) -> this rank's rows -> old log-probs -> token filters -> PPO epochs over
    mini-batches -> weight sync -> metrics -> held-out evaluation -> run checkpoint

Where it departs from the textbook: void trajectories (SimpleTIR) shape their group's
advantages but get no gradient; infrastructure failures count nowhere (``megatron_tir.rl.rows``).
The run stops (exit 1, nothing new saved) when it cannot learn: a step mostly ended by
infrastructure failures (the rollout source), or ``trainer.stop.steps_without_update`` steps
in a row without an optimizer update.
"""

from __future__ import annotations

import functools
import logging
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from megatron_tir.finite import NonFiniteTraining
from megatron_tir.observe.probe import TurnProbe
from megatron_tir.observe.run_log import StepObserver
from megatron_tir.observe.trackers import open_trackers
from megatron_tir.policy.checkpoint.layout import CRITIC, POLICY
from megatron_tir.policy.losses import TokenLoss
from megatron_tir.policy.memory import TrainingMemory
from megatron_tir.policy.parallel import collective_device
from megatron_tir.rl import MODES, PolicyLoss
from megatron_tir.train.batch import Update, build_update, mini_batches, stage_update, with_behaviour_weights
from megatron_tir.train.checkpoint import RunCheckpoints, TrainerState
from megatron_tir.train.critic_update import critic_metrics, critic_step, gae_advantages
from megatron_tir.train.config import TrainConfig
from megatron_tir.train.data import held_out_problems
from megatron_tir.train.metrics import open_metrics
from megatron_tir.train.preempt import StopSignals, agreed
from megatron_tir.train.rollout_source import RolloutSource, StepRollouts, TrainingStopped
from megatron_tir.train.row_stats import RowStats, reduce_over_replicas

log = logging.getLogger(__name__)


@contextmanager
def _timed(timings: dict, name: str):
    t0 = time.perf_counter()
    yield
    timings[f"time/{name}"] = time.perf_counter() - t0


def train(cfg: TrainConfig, run_dir: Path, state: TrainerState, *, learner, source: RolloutSource,
          reference=None, critic=None, stop: StopSignals | None = None) -> TrainerState:
    """Run steps ``state.step + 1 .. cfg.trainer.steps``; ``reference``: a frozen learner of the
    initial policy (KL term), else None; ``critic`` the value learner of ``trainer.ppo.advantage=gae``
    (``megatron_tir.train.critic_update``), else None; ``stop`` the run's ``StopSignals`` (a signal
    ends the run after the step in progress, with a checkpoint)."""
    tc = cfg.trainer
    ckpts = RunCheckpoints(run_dir, keep_last=tc.checkpoint.keep_last)
    # a resume drops what steps after its checkpoint wrote (metrics lines, TensorBoard events); a fresh
    # start in a reused directory (no checkpoint) drops everything an earlier attempt wrote
    sink = open_metrics(run_dir, truncate_to=state.metrics_offset,
                        trackers=lambda: open_trackers(tc.log, run_dir, state.config,
                                                       purge_step=state.step + 1 if state.step else 0))
    observer = StepObserver(cfg, run_dir, tokenizer=source.tokenizer, sink=sink) if source.rank == 0 else _NoObserver()
    held_out = held_out_problems(cfg.data)
    temperature = cfg.rollout.temperature or 1.0
    memory = TrainingMemory([learner, critic], colocated=cfg.engine.colocated)
    if state.step == 0 and held_out:  # rank 0 evaluates; the others wait through the hand-off, not in a collective
        def step0() -> None:
            sink.log(0, source.evaluate(held_out, observe=functools.partial(observer.held_out, 0))
                     | {"time/unix": time.time()})
        source.rank0_phase("eval/0", step0, what="the step-0 held-out evaluation")
    one_step = tc.asynchrony.mode == "one_step"  # full: the source's producer never stops (group_producer.py)
    steps_without_update = 0
    nonfinite = 0  # consecutive steps with non-finite gradients or weights
    pending_ckpt_s, last_save = None, time.monotonic()
    engine_mark = [time.perf_counter(), source.engine_busy_s()]  # the engine idle share's window: since the last step
    for step in _progress(range(state.step + 1, tc.steps + 1), enabled=tc.progress):
        timings: dict[str, float] = {} if pending_ckpt_s is None else {"time/checkpoint": pending_ckpt_s}
        # 1. this rank's rows of the step's rollouts (rank 0 samples them; the others wait for their share).
        # trainer.async=one_step: step + 1's rollouts start now and run while this step trains (with the
        # weights this step trains from: one version stale), drained before the sync below.
        if not source.submitted(step):
            source.submit(step)
        with _timed(timings, "rollout_wait"):
            got = source.next(step)
        ahead = one_step and step < tc.steps
        if ahead:
            source.submit(step + 1)
        metrics = dict(got.metrics)
        # 2. the update, then the new weights to the engines. Colocated: the engine frees its memory and
        # the trainer takes its gradient buffers and optimizer state back for the update, then gives them
        # back (and empties its allocator cache) before the engine resumes at the sync.
        if got.rows is not None:
            source.offload(step)
            memory.reclaim()
        metrics |= update_policy(cfg, got, learner, timings, temperature=temperature, reference=reference,
                                 critic=critic, critic_only=step <= cfg.critic.warmup_steps)
        if got.rows is not None:
            nonfinite = _check_finite_steps(step, metrics, nonfinite, tc.stop_after_nonfinite)
            memory.release()
            if ahead:
                with _timed(timings, "drain"):
                    source.drain(step + 1)  # generation drained before the push: each group from one version
            with _timed(timings, "sync"):
                source.sync_weights(learner)
        updated = metrics.get("train/optimizer_steps", 0) > metrics.get("train/skipped_steps", 0) or (
            metrics.get("critic/warmup") == 1.0 and metrics.get("critic/skipped", 1.0) < 1.0)  # the critic learned
        steps_without_update = 0 if updated else steps_without_update + 1
        state.step, state.data_position, state.schedule_switched_at = step, got.data_position, got.schedule_switched_at
        state.data_consumed_ahead = list(got.data_consumed_ahead)
        max_turns, max_tokens = got.rollout_budget
        metrics |= {"budget/max_turns": max_turns, "budget/max_response_tokens": max_tokens, "train/lr": learner.lr}
        # 3. rank 0 alone: held-out evaluation, observers (dumps, plots), the metrics line; the other ranks
        # wait through the hand-off (a 32B evaluation takes minutes: longer than a collective's timeout)
        evaluate = bool(held_out) and (step == tc.steps or (tc.eval_every and step % tc.eval_every == 0))
        source.rank0_phase(f"end/{step}", functools.partial(
            _end_step, source, observer, sink, step, got, metrics, timings, held_out if evaluate else None,
            engine_mark), what=f"rank 0 to end step {step} (held-out evaluation, metrics)")
        source.forget(f"end/{step - 2}")
        if steps_without_update >= tc.stop.steps_without_update:
            raise TrainingStopped(f"{steps_without_update} steps in a row without an update (last: step {step}; "
                                  f"trainer.stop.steps_without_update={tc.stop.steps_without_update}): the run "
                                  f"is learning nothing")
        # 4. the checkpoint covers this step's metrics line; its save time is logged with the next step.
        pending_ckpt_s = None
        stopping, time_due = agreed(stop is not None and stop.received is not None,
                                    tc.checkpoint.minutes > 0 and time.monotonic() - last_save >= 60 * tc.checkpoint.minutes)
        if stopping or time_due or step == tc.steps or (tc.checkpoint.every and step % tc.checkpoint.every == 0):
            t0 = time.perf_counter()
            state.metrics_offset = sink.offset
            ckpts.save({POLICY: learner} | ({CRITIC: critic} if critic is not None else {}), state)
            pending_ckpt_s, last_save = time.perf_counter() - t0, time.monotonic()
        if stopping:
            log.warning("stopped after step %d on a signal; the run continues from its checkpoint (--resume)", step)
            break
    observer.close()
    sink.close()
    return state


def _end_step(source: RolloutSource, observer, sink, step: int, got: StepRollouts, metrics: dict, timings: dict,
              held_out, engine_mark: list) -> None:
    """Rank 0's end of a step: the observers see the sampled groups, the held-out evaluation (when
    ``held_out``), the trainer and engine idle shares, the metrics line."""
    observer.sampled(step, got.collected)
    if held_out:
        with _timed(timings, "eval"):
            metrics |= source.evaluate(held_out, observe=functools.partial(observer.held_out, step))
    metrics |= observer.end_step(step, metrics | timings)
    if metrics.get("time/step"):  # the share of the step the trainer spent waiting for rollouts
        waited = timings.get("time/rollout_wait", 0.0) + timings.get("time/drain", 0.0)
        metrics["train/trainer_idle_share"] = min(1.0, waited / metrics["time/step"])
    # the share of the step no generation request was in flight (eval included)
    now, busy = time.perf_counter(), source.engine_busy_s()
    if now > engine_mark[0]:
        share = 1 - (busy - engine_mark[1]) / (now - engine_mark[0])
        metrics["rollout/engine_idle_share"] = min(1.0, max(0.0, share))
    engine_mark[:] = [now, busy]
    sink.log(step, metrics | timings | {"time/unix": time.time()})


def update_policy(cfg: TrainConfig, got: StepRollouts, learner, timings: dict, *, temperature: float,
                  reference=None, critic=None, critic_only: bool = False) -> dict[str, float]:
    """Old log-probs and the mode's token filter, then PPO epochs over mini-batches of this rank's
    rows (every rank of the world takes the same number of optimizer steps); the train metrics,
    of every replica's rows, on every rank. With a ``critic``: GAE advantages from its values and a
    critic step before each policy step (``critic_only``: the critic's warm-up, no policy step).
    A pipeline stage holds what it reads of the rows (``megatron_tir.train.batch.stage_fields``):
    the loss inputs are prepared on the last stage only, the forward passes run on every stage."""
    tc = cfg.trainer
    if got.rows is None:
        log.warning("no group passed the filters; no update")
        return {"train/skipped_empty_batch": 1.0}
    rows = got.rows
    with _timed(timings, "logprobs"), _phase_bar(tc.progress, "log-probs", None, unit="micro-batch") as bar:
        tick = lambda: bar.update(1)  # noqa: E731
        if tc.ppo.old_logprobs == "learner":  # None past the last stage (which alone reads them)
            old_BT = learner.logprobs(rows.tokens_BT, rows.attention_mask_BT, temperature=temperature, local_rows=True,
                                      tick=tick)
        else:
            old_BT = rows.engine_logprobs_BT
        ref_BT = None if reference is None else reference.logprobs(rows.tokens_BT, rows.attention_mask_BT,
                                                                   temperature=temperature, local_rows=True, tick=tick)
    values_BT = None
    if critic is not None:
        with _timed(timings, "values"):
            values_BT = critic.values(rows.tokens_BT, rows.attention_mask_BT, local_rows=True)
    stats = None
    if rows.loss_mask_BT is not None:  # this stage computes the loss
        update, stats = _loss_batch(cfg, rows, old_BT, ref_BT, values_BT)
    else:
        update = stage_update(rows)
    stats = reduce_over_replicas(stats)  # every replica's rows, on every rank
    critic_steps: list[dict[str, float]] = []
    bound = tc.filters.high_ratio_bound if MODES[tc.mode].high_ratio_filter else None
    loss_fn = TurnProbe(PolicyLoss(tc.loss, high_ratio_bound=bound), n_turns=got.turns)
    token_loss = TokenLoss(token_loss=loss_fn, temperature=temperature, with_entropy=True)  # entropy: a diagnostic
    results = []
    with _timed(timings, "train"), _phase_bar(tc.progress, "update", tc.ppo.epochs * got.mini_batches) as bar:
        for _ in range(tc.ppo.epochs):
            for mb in mini_batches(update, got.mini_batches):
                if critic is not None:
                    critic_steps.append(critic_step(critic, mb, cfg.critic, tc.loss.aggregation, local_rows=True))
                if not critic_only:
                    results.append(learner.train_step(mb, token_loss, aggregation=tc.loss.aggregation,
                                                      local_rows=True))
                bar.update(1)
    max_ratio = loss_fn.loss_fn.max_ratio_tensor  # on the loss's device: the group's backend needs it there
    if max_ratio is None:
        max_ratio = torch.zeros((), device=collective_device())
    torch.distributed.all_reduce(max_ratio, op=torch.distributed.ReduceOp.MAX)
    metrics = {
        "filter/low_prob_tokens_masked": stats.totals.get("filter/low_prob_tokens_masked", 0.0),
        "train/optimizer_steps": float(len(results)),
        "train/skipped_steps": float(sum(r.skipped for r in results)),
        "train/empty_steps": float(sum(r.empty for r in results)),  # every loss token masked: no step taken
        "train/nonfinite_weights": float(sum(not r.weights_finite for r in results)),
        "train/max_ratio": float(max_ratio),
    } | (critic_metrics(stats) if critic is not None else {}) | _offpolicy_metrics(stats)
    if critic_steps:
        metrics["critic/warmup"] = float(critic_only)
        metrics["critic/empty_steps"] = sum(s["critic/empty"] for s in critic_steps)
        if stepped := [s for s in critic_steps if not s["critic/empty"]]:  # empty steps would pull the means to 0
            metrics |= {k: sum(s[k] for s in stepped) / len(stepped) for k in stepped[0] if k != "critic/empty"}
    trained = [r for r in results if not r.empty]  # the same on every rank (critic_only and the empty steps are)
    if trained:
        metrics |= {"train/loss": sum(r.loss for r in trained) / len(trained),
                    "train/grad_norm": sum(r.grad_norm for r in trained) / len(trained),
                    "train/padding_share": sum(r.padding_share for r in trained) / len(trained)}
        means = {key: sum(r.metrics[key] for r in trained) / len(trained) for key in trained[0].metrics}
        metrics |= {f"train/{k}": v for k, v in loss_fn.finish(means).items()}
    return metrics


def _loss_batch(cfg: TrainConfig, rows, old_BT, ref_BT, values_BT) -> tuple[Update, RowStats]:
    """The update of the stage that computes the loss: the mode's token filter, the critic's GAE
    advantages, the off-policy correction; the sums of their metrics over this replica's rows."""
    tc = cfg.trainer
    update = build_update(rows, old_BT, mode=tc.mode, low_prob_fraction=tc.filters.low_prob_fraction,
                          ref_logprobs_BT=ref_BT)
    stats = RowStats(totals={"filter/low_prob_tokens_masked": float(update.low_prob_masked)})
    if values_BT is not None:
        update.batch, critic_stats = gae_advantages(update.batch, rows.rewards_B, values_BT, cfg.critic,
                                                    model_mask_BT=rows.loss_mask_BT, behaviour_BT=old_BT,
                                                    ref_BT=ref_BT, local_rows=True)
        stats = stats.merge(critic_stats)
    if tc.asynchrony.mode != "off":  # the decoupled objective: old_BT is the proximal policy, the engine's the behaviour
        on_BT = update.batch.loss_mask_BT > 0
        update.batch, correction = with_behaviour_weights(update.batch, rows.engine_logprobs_BT,
                                                          cap=tc.asynchrony.cap, mode=tc.asynchrony.correction)
        if correction:  # the correction's means over the loss tokens (weight_mean: over the kept ones)
            on, kept = float(on_BT.sum()), float((update.batch.loss_mask_BT > 0).sum())
            for k, v in correction.items():
                if k == "weight_max":
                    stats.maxima["offpolicy/weight_max"] = v
                else:
                    n = kept if k == "weight_mean" else on
                    stats.means[f"offpolicy/{k}"] = (v * n, n)
    return update, stats


def _offpolicy_metrics(stats: RowStats) -> dict[str, float]:
    out = {k: stats.mean(k) for k in stats.means if k.startswith("offpolicy/")}
    return out | {k: v for k, v in stats.maxima.items() if k.startswith("offpolicy/")}


def _check_finite_steps(step: int, metrics: dict, before: int, limit: int) -> int:
    """Consecutive non-finite steps so far (every rank sees the same all-reduced flags);
    NonFiniteTraining once ``limit`` are reached."""
    skipped, bad_weights = metrics.get("train/skipped_steps", 0.0), metrics.get("train/nonfinite_weights", 0.0)
    if not (skipped or bad_weights):
        return 0
    count = before + 1
    if count >= limit:
        cause = "non-finite weights" if bad_weights else "non-finite gradients (every such optimizer step skipped)"
        raise NonFiniteTraining(f"stopped at step {step}: {count} consecutive steps with {cause} "
                                f"(trainer.stop_after_nonfinite={limit}); the checkpoints hold only finite weights")
    return count


class _NoObserver:
    """The step observer of the ranks that write nothing (all but rank 0)."""

    def sampled(self, step: int, collected) -> None:
        pass

    def held_out(self, step: int, groups) -> None:
        pass

    def end_step(self, step: int, metrics: dict) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


def _phase_bar(progress: bool, desc: str, total: int | None, *, unit: str = "step"):
    """A progress bar (optimizer steps, micro-batches) on rank 0 when ``progress`` and stderr is a terminal."""
    from tqdm import tqdm

    show = progress and torch.distributed.get_rank() == 0
    return tqdm(total=total, desc=desc, unit=unit, leave=False, disable=None if show else True)


def _progress(steps, *, enabled: bool):
    """A progress bar over the steps on rank 0 (when ``enabled``)."""
    if not enabled or torch.distributed.get_rank() != 0:
        return steps
    from tqdm import tqdm

    return tqdm(steps, desc="train", unit="step", disable=None)  # bars only on a terminal

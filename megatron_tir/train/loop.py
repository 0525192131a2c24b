"""The training loop for multi-turn TIR, top to bottom. Every trainer rank runs ``train``.

    rollouts (rank 0's producer: engine, sandbox, rewards, group filter, row roles, group advantages)
    -> this rank's rows (the hand-off) -> the algorithm's update (old log-probs, values, token
    filters, PPO epochs over mini-batches: megatron_tir.train.algorithm) -> weight sync ->
    held-out evaluation and metrics (rank 0; the others wait through the hand-off) -> run checkpoint

Where it departs from the textbook: void trajectories (SimpleTIR) shape their group's
advantages but get no gradient; infrastructure failures count nowhere (``megatron_tir.rl.rows``).
The run stops (exit 1, nothing new saved) when it cannot learn: a step mostly ended by
infrastructure failures (the producer's header), or ``trainer.stop.steps_without_update`` steps
in a row without an optimizer update.
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path

import torch

from megatron_tir.finite import NonFiniteTraining
from megatron_tir.observe.diagnostics import GradNormSpikes
from megatron_tir.observe.run_log import StepObserver
from megatron_tir.observe.trackers import open_trackers
from megatron_tir.policy.memory import TrainingMemory
from megatron_tir.train.algorithm import PolicyGradient, StepStats, timed
from megatron_tir.train.batch import StepRollouts
from megatron_tir.train.checkpoint import RunCheckpoints, TrainerState
from megatron_tir.train.config import TrainConfig
from megatron_tir.train.data import held_out_problems
from megatron_tir.train.handoff import HandOff, TrainingStopped
from megatron_tir.train.metrics import open_metrics
from megatron_tir.train.preempt import StopSignals, agreed
from megatron_tir.train.producer import Producer
from megatron_tir.train.weight_push import WeightPush

log = logging.getLogger(__name__)


def train(cfg: TrainConfig, run_dir: Path, state: TrainerState, *, algorithm: PolicyGradient, handoff: HandOff,
          producer: Producer | None, weights: WeightPush, stop: StopSignals | None = None) -> TrainerState:
    """Run steps ``state.step + 1 .. cfg.trainer.steps`` with ``algorithm`` (its learners are what a run
    checkpoint holds), the rollouts' parts (``megatron_tir.train.run.open_rollouts``: ``producer`` is rank 0's,
    None elsewhere); ``stop`` the run's ``StopSignals`` (a signal ends the run after the step in progress,
    with a checkpoint)."""
    tc = cfg.trainer
    ckpts = RunCheckpoints(run_dir, keep_last=tc.checkpoint.keep_last)
    # a resume drops what steps after its checkpoint wrote (metrics lines, TensorBoard events); a fresh
    # start in a reused directory (no checkpoint) drops everything an earlier attempt wrote
    sink = open_metrics(run_dir, truncate_to=state.metrics_offset,
                        trackers=lambda: open_trackers(tc.log, run_dir, state.config,
                                                       purge_step=state.step + 1 if state.step else 0))
    observer = StepObserver(cfg, run_dir, tokenizer=producer.service.tokenizer, sink=sink) if producer else _NoObserver()
    observer.spikes.restore(state.grad_norm_history)  # a resume continues the grad-norm statistics
    held_out = held_out_problems(cfg.data)
    memory = TrainingMemory(list(algorithm.learners.values()), colocated=cfg.engine.colocated)
    if state.step == 0 and held_out:  # rank 0 evaluates; the others wait through the hand-off, not in a collective
        handoff.rank0_phase("eval/0", functools.partial(_evaluate_step0, producer, observer, sink, held_out),
                            what="the step-0 held-out evaluation")
    steps_without_update = nonfinite = 0  # nonfinite: consecutive steps with non-finite gradients or weights
    pending_ckpt_s, last_save = None, time.monotonic()
    # the engine idle share's window (rank 0): since the last step
    engine_mark = [time.perf_counter(), producer.service.engine_busy_s() if producer else 0.0]
    for step in _progress(range(state.step + 1, tc.steps + 1), enabled=tc.progress):
        timings: dict[str, float] = {} if pending_ckpt_s is None else {"time/checkpoint": pending_ckpt_s}
        # 1. this rank's rows of the step's rollouts (rank 0 samples them; the others wait for their share)
        with timed(timings, "rollout_wait"):
            got = handoff.take(step, producer)
        # 2. the update, then the new weights to the engines. Colocated: the engine frees its memory and the
        # trainer takes its gradient buffers and optimizer state back for the update, then gives them back
        # (and empties its allocator cache) before the engine resumes at the sync.
        if got.rows is not None:
            weights.free_engine(step)
            memory.reclaim()
        stats = algorithm.update(step, got, timings)
        if got.rows is not None:
            nonfinite = _check_finite_steps(step, stats, nonfinite, tc.stop_after_nonfinite)
            memory.release()
            weights.after_update(step, algorithm.policy, timings)  # rollouts run ahead drained, then the sync
        steps_without_update = 0 if stats.updated else steps_without_update + 1
        state.step, state.data_position, state.schedule_switched_at = step, got.data_position, got.schedule_switched_at
        state.data_consumed_ahead = list(got.data_consumed_ahead)
        metrics = got.metrics | stats.metrics | _budget_and_lr(got, algorithm.policy.lr)
        # 3. rank 0 alone: held-out evaluation, observers (dumps, plots), the metrics line; the other ranks
        # wait through the hand-off (a 32B evaluation takes minutes: longer than a collective's timeout)
        evaluate = bool(held_out) and (step == tc.steps or (tc.eval_every and step % tc.eval_every == 0))
        handoff.rank0_phase(f"end/{step}", functools.partial(
            _end_step, producer, observer, sink, step, got, metrics, timings, held_out if evaluate else None,
            engine_mark), what=f"rank 0 to end step {step} (held-out evaluation, metrics)")
        handoff.forget(f"end/{step - 2}")
        _check_learning(step, steps_without_update, tc.stop.steps_without_update)
        # 4. the checkpoint covers this step's metrics line; its save time is logged with the next step.
        pending_ckpt_s = None
        stopping, time_due = agreed(stop is not None and stop.received is not None,
                                    tc.checkpoint.minutes > 0 and time.monotonic() - last_save >= 60 * tc.checkpoint.minutes)
        if stopping or time_due or step == tc.steps or (tc.checkpoint.every and step % tc.checkpoint.every == 0):
            t0 = time.perf_counter()
            state.metrics_offset, state.grad_norm_history = sink.offset, observer.spikes.history
            if producer is not None:  # rank 0: the engine's weight version (a resume continues it)
                state.weight_version = producer.service.weight_version
            ckpts.save(algorithm.learners, state)
            pending_ckpt_s, last_save = time.perf_counter() - t0, time.monotonic()
        if stopping:
            log.warning("stopped after step %d on a signal; the run continues from its checkpoint (--resume)", step)
            break
    sink.close()
    return state


def _evaluate_step0(producer: Producer, observer, sink, held_out) -> None:
    sink.log(0, producer.evaluate(held_out, observe=functools.partial(observer.held_out, 0)) | {"time/unix": time.time()})


def _end_step(producer: Producer, observer, sink, step: int, got: StepRollouts, metrics: dict, timings: dict,
              held_out, engine_mark: list) -> None:
    """Rank 0's end of a step: the observers see the sampled groups, the held-out evaluation (when
    ``held_out``), the trainer and engine idle shares, the metrics line."""
    observer.sampled(step, got.sampled, got.fates)
    if held_out:
        with timed(timings, "eval"):
            metrics |= producer.evaluate(held_out, observe=functools.partial(observer.held_out, step))
    metrics |= observer.end_step(step, metrics | timings)
    if metrics.get("time/step"):  # the share of the step the trainer spent waiting for rollouts
        waited = timings.get("time/rollout_wait", 0.0) + timings.get("time/drain", 0.0)
        metrics["train/trainer_idle_share"] = min(1.0, waited / metrics["time/step"])
    # the share of the step no generation request was in flight (eval included)
    now, busy = time.perf_counter(), producer.service.engine_busy_s()
    if now > engine_mark[0]:
        share = 1 - (busy - engine_mark[1]) / (now - engine_mark[0])
        metrics["rollout/engine_idle_share"] = min(1.0, max(0.0, share))
    engine_mark[:] = [now, busy]
    sink.log(step, metrics | timings | {"time/unix": time.time()})


def _budget_and_lr(got: StepRollouts, lr: float) -> dict[str, float]:
    max_turns, max_tokens = got.rollout_budget
    return {"budget/max_turns": max_turns, "budget/max_response_tokens": max_tokens, "train/lr": lr}


def _check_learning(step: int, steps_without_update: int, limit: int) -> None:
    """TrainingStopped once ``limit`` steps in a row took no update (every rank sees the same count)."""
    if steps_without_update >= limit:
        raise TrainingStopped(f"{steps_without_update} steps in a row without an update (last: step {step}; "
                              f"trainer.stop.steps_without_update={limit}): the run is learning nothing")


def _check_finite_steps(step: int, stats: StepStats, before: int, limit: int) -> int:
    """Consecutive non-finite steps so far (every rank sees the same all-reduced flags);
    NonFiniteTraining once ``limit`` are reached."""
    skipped, bad_weights = stats.skipped, stats.nonfinite_weights
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

    def __init__(self) -> None:
        self.spikes = GradNormSpikes()  # restored on resume, never updated: these ranks write no trainer state

    def sampled(self, step: int, sampled, fates) -> None:
        pass

    def held_out(self, step: int, groups, metrics: dict) -> None:
        pass

    def end_step(self, step: int, metrics: dict) -> dict[str, float]:
        return {}


def _progress(steps, *, enabled: bool):
    """A progress bar over the steps on rank 0 (when ``enabled``)."""
    if not enabled or torch.distributed.get_rank() != 0:
        return steps
    from tqdm import tqdm

    return tqdm(steps, desc="train", unit="step", disable=None)  # bars only on a terminal

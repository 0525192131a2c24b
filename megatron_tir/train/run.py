"""Set up one trainer rank (process groups, learner, the rollouts' parts), run the loop, tear down.

The rollouts' parts (:func:`open_rollouts`, every rank): the :class:`~megatron_tir.train.handoff.HandOff`
(how rows and rank-0 phases reach every rank), rank 0's :class:`~megatron_tir.train.producer.Producer`
(engine, sandbox and verifier behind it; None on the other ranks) and the
:class:`~megatron_tir.train.weight_push.WeightPush` (the engine's side of an update).
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import NamedTuple

import torch

from megatron_tir.observe.log_file import run_log_file
from megatron_tir.rollout.engines.base import PauseMode
from megatron_tir.train.checkpoint import RunCheckpoints, TrainerState
from megatron_tir.train.config import TrainConfig
from megatron_tir.train.algorithm import algorithm_class, build_algorithm
from megatron_tir.train.handoff import HandOff
from megatron_tir.train.loop import train
from megatron_tir.train.preempt import StopSignals
from megatron_tir.train.producer import Producer
from megatron_tir.train.weight_push import WeightPush

log = logging.getLogger(__name__)


def run_training(cfg: TrainConfig, run_dir: Path, state: TrainerState, *, resume: bool) -> TrainerState:
    """Every rank calls this with the same arguments; returns the final trainer state."""
    from megatron_tir.model_sources import resolve_model
    from megatron_tir.policy.learner import Learner
    from megatron_tir.policy.parallel import destroy_parallel, init_parallel
    from megatron_tir.train.rollouts import RolloutService

    torch.manual_seed(cfg.trainer.seed)
    init_parallel(cfg.learner.tp, cfg.learner.pp, seed=cfg.learner.seed, ep=cfg.learner.ep,
                  timeout_s=cfg.trainer.collective_timeout_s, model_parallel_timeout_s=cfg.trainer.collective_timeout_s)
    try:
        # rank 0's RUN_DIR/train.log from the learner's start-up line on; a new run directory gets its files once
        # start-up succeeded (start_service makes it): the records wait until then (megatron_tir.observe.log_file)
        with run_log_file(run_dir, rank0=torch.distributed.get_rank() == 0, create=False):
            algorithm_class(cfg)  # a bad trainer.ppo.algorithm is one line before the learner is built
            learner = Learner(cfg.learner)
            algorithm = build_algorithm(cfg, learner)  # builds the critic and the frozen reference where it needs them
            if resume:
                loaded = RunCheckpoints(run_dir, keep_last=cfg.trainer.checkpoint.keep_last).load(
                    algorithm.learners, strict=cfg.trainer.checkpoint.strict_resume,
                    allow_unverified=cfg.trainer.checkpoint.allow_unverified)
                if loaded.step != state.step:  # fell back past a damaged checkpoint: the later overrides apply from here
                    state.overrides = loaded.overrides + [o | {"step": loaded.step + 1}
                                                          for o in state.overrides[len(loaded.overrides):]]
                state.step, state.data_position = loaded.step, loaded.data_position
                state.data_consumed_ahead = list(loaded.data_consumed_ahead)
                state.metrics_offset, state.schedule_switched_at = loaded.metrics_offset, loaded.schedule_switched_at
                state.grad_norm_history, state.weight_version = list(loaded.grad_norm_history), loaded.weight_version
                log.info("resumed %s at step %d (data position %d)", run_dir, state.step, state.data_position)

            def start_service() -> RolloutService:  # rank 0 only
                # full: a sync retracts the requests in flight, which continue under the new weights
                pause = PauseMode.RETRACT if cfg.trainer.asynchrony.mode == "full" else PauseMode.ABORT
                service = RolloutService(engine_cfg=cfg.engine, sandbox_cfg=cfg.sandbox, reward_cfg=cfg.reward,
                                         model_dir=resolve_model(cfg.model), tools=cfg.rollout.tools, pause_mode=pause)
                # start-up succeeded: only now does the run directory get its files
                run_dir.mkdir(parents=True, exist_ok=True)
                (run_dir / "config.json").write_text(json.dumps(state.config, indent=1))
                return service

            with open_rollouts(cfg, service_factory=start_service, position=state.data_position,
                               schedule_switched_at=state.schedule_switched_at,
                               consumed_ahead=state.data_consumed_ahead) as r:
                if resume:  # the engines start from the base weights: give them the policy's, at the saved version
                    r.weights.update(learner, version=state.weight_version or None)
                with StopSignals() as stop:  # SIGUSR1 (Slurm's pre-timeout signal) / SIGTERM: checkpoint, exit 0
                    return train(cfg, run_dir, state, algorithm=algorithm, handoff=r.handoff, producer=r.producer,
                                 weights=r.weights, stop=stop)
    finally:
        destroy_parallel()


class Rollouts(NamedTuple):
    handoff: HandOff
    producer: Producer | None  # rank 0's; None elsewhere
    weights: WeightPush


@contextlib.contextmanager
def open_rollouts(cfg: TrainConfig, *, service_factory, position: int = 0, schedule_switched_at: int | None = None,
                  consumed_ahead=(), pad_id: int | None = None, poll_s: float = 1.0, alive_timeout_s: float = 300.0):
    """Every rank, collectively: the hand-off, rank 0's producer over ``service_factory()`` (called on rank 0
    only: the started :class:`~megatron_tir.train.rollouts.RolloutService`; a failure there ends every rank
    with its one-line cause) and the weight push; closed in that order (the service last) on the way out.
    ``position``, ``schedule_switched_at`` and ``consumed_ahead`` come from the trainer state."""
    handoff = HandOff(poll_s=poll_s, alive_timeout_s=alive_timeout_s)
    service = producer = weights = None

    def start() -> tuple:  # rank 0 only
        nonlocal service
        service = service_factory()
        return service, Producer(cfg, service, position=position, consumed_ahead=consumed_ahead,
                                 schedule_switched_at=schedule_switched_at, pad_id=pad_id, dp_size=handoff.dp_size)
    try:
        _, producer = handoff.start(start, what="rank 0's engine and sandbox to start") or (None, None)
        weights = WeightPush(cfg, handoff, producer)
        yield Rollouts(handoff, producer, weights)
    finally:
        handoff.close()
        if producer is not None:
            try:
                producer.stop()
            except Exception:  # noqa: BLE001 - closing after a failure: the service's close reports it
                log.exception("stopping the group producer")
        if weights is not None:
            weights.close()
        if service is not None:
            service.close()

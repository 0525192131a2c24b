"""The GRPO training loop for multi-turn TIR, top to bottom. Every trainer rank runs ``train``.

    prompts -> rollouts (rank 0: async driver, engine, sandbox) -> rewards -> group filter
    (dynamic sampling) -> batch to every rank (collective) -> old log-probs -> row roles,
    advantages, token filters -> PPO epochs over mini-batches -> weight sync (engines paused)
    -> metrics -> held-out evaluation -> run checkpoint

Where it departs from the textbook: void trajectories (SimpleTIR) shape their group's
advantages but get no gradient; infrastructure failures count nowhere (``megatron_tir.rl.rows``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from megatron_tir.policy.checkpoint.layout import CRITIC, POLICY
from megatron_tir.policy.losses import TokenLoss
from megatron_tir.policy.parallel import collective_device
from megatron_tir.rl import MODES, PolicyLoss
from megatron_tir.rollout.batch import weight_version_metrics
from megatron_tir.rollout.sync import drain
from megatron_tir.train.batch import RolloutTensors, build_update, collect_groups, mini_batches, to_tensors
from megatron_tir.train.critic_update import critic_step, gae_advantages
from megatron_tir.train.checkpoint import RunCheckpoints, TrainerState
from megatron_tir.train.config import TrainConfig
from megatron_tir.train.data import PromptStream, held_out_problems
from megatron_tir.train.preempt import StopSignals, agreed
from megatron_tir.train.metrics import MetricsSink, rollout_metrics
from megatron_tir.observe.probe import TurnProbe
from megatron_tir.observe.run_log import StepObserver
from megatron_tir.observe.trackers import open_trackers
from megatron_tir.train.schedule import schedule_due, switched

log = logging.getLogger(__name__)


def _broadcast(obj):
    if torch.distributed.get_world_size() == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


@contextmanager
def _timed(timings: dict, name: str):
    t0 = time.perf_counter()
    yield
    timings[f"time/{name}"] = time.perf_counter() - t0


def train(cfg: TrainConfig, run_dir: Path, state: TrainerState, *, learner, worker, reference=None,
          critic=None, stop: StopSignals | None = None) -> TrainerState:
    """Run steps ``state.step + 1 .. cfg.trainer.steps``; ``worker`` is the RolloutWorker on rank 0, else None;
    ``reference`` a frozen learner of the initial policy (KL term), else None; ``critic`` the value
    learner of ``trainer.ppo.advantage=gae`` (``megatron_tir.train.critic_update``), else None; ``stop``
    the run's ``StopSignals`` (a signal ends the run after the step in progress, with a checkpoint)."""
    tc, rank = cfg.trainer, torch.distributed.get_rank()
    ckpts = RunCheckpoints(run_dir, keep_last=tc.checkpoint.keep_last)
    stream = PromptStream(cfg.data, position=state.data_position)
    sink = MetricsSink(run_dir, truncate_to=state.metrics_offset if state.step else None,
                       trackers=open_trackers(tc.log, run_dir, state.config)) if rank == 0 else None
    observer = StepObserver(cfg, run_dir, tokenizer=worker.tokenizer, sink=sink) if rank == 0 else None
    held_out = held_out_problems(cfg.data)
    temperature = cfg.rollout.temperature or 1.0
    lengths: list[float] = []  # mean response length per step, for the plateau rule (restarts on a resume)
    rollout_cfg = cfg.rollout if state.schedule_switched_at is None else switched(cfg.rollout, tc.turn_schedule)
    if rank == 0 and state.step == 0 and held_out:
        sink.log(0, evaluate(cfg, worker, held_out, rollout_cfg, observe=functools.partial(observer.held_out, 0))
                 | {"time/unix": time.time()})
    steps = range(state.step + 1, tc.steps + 1)
    if rank == 0 and tc.progress:
        from tqdm import tqdm

        steps = tqdm(steps, desc="train", unit="step", disable=None)  # bars only on a terminal
    pending_ckpt_s, last_save = None, time.monotonic()
    for step in steps:
        timings: dict[str, float] = {} if pending_ckpt_s is None else {"time/checkpoint": pending_ckpt_s}
        metrics: dict[str, float] = {}
        # 1. rollouts on rank 0, dynamic sampling; the kept groups go to every rank.
        if rank == 0 and state.schedule_switched_at is None and schedule_due(step, tc.turn_schedule, lengths):
            rollout_cfg, state.schedule_switched_at = switched(cfg.rollout, tc.turn_schedule), step
            log.info("turn schedule: %d turns, %d tokens from step %d", rollout_cfg.max_turns,
                     rollout_cfg.max_response_tokens, step)
        rt = None
        with _timed(timings, "rollout"):
            if rank == 0:
                one_round = functools.partial(_sample_round, worker, stream, tc.sampling.prompts_per_round, rollout_cfg,
                                              tc.progress)
                got = worker.runner.run(collect_groups(one_round, want=tc.sampling.prompts_per_step,
                                                       max_rounds=tc.sampling.max_rounds, drop_zero_std=tc.filters.drop_zero_std,
                                                       accuracy_lo=tc.filters.accuracy_lo, accuracy_hi=tc.filters.accuracy_hi,
                                                       overlong=tc.filters.overlong,
                                                       min_rows=tc.filters.min_group_rows,
                                                       strategy=tc.sampling.strategy, seed=tc.seed * 100003 + step))
                metrics |= rollout_metrics(got.sampled)
                if stale := worker.take_stale_responses():  # a server restarted with other weights
                    metrics["rollout/stale_responses_dropped"] = float(stale)
                    log.warning("step %d: %d answers from servers with stale weights dropped and retried", step, stale)
                observer.sampled(step, got)
                metrics |= {f"filter/groups_{k}": float(v) for k, v in got.removed.items()}
                metrics |= {"filter/groups_kept": float(len(got.groups)), "filter/sample_rounds": float(got.rounds)}
                lengths.append(metrics.get("rollout/mean_response_tokens", 0.0))
                rt = to_tensors(got.groups, pad_id=_pad_id(worker.tokenizer)).as_dict() if got.groups else None
        rt = _broadcast(rt)
        if rt is not None:
            if rank == 0:  # a colocated engine gives its memory back while the trainer trains
                worker.offload()
            metrics |= update_policy(cfg, RolloutTensors(**rt), learner, timings, temperature, reference,
                                     critic=critic, critic_only=step <= cfg.critic.warmup_steps)
            # 2. new weights to the engines, paused around the copy.
            with _timed(timings, "sync"):
                worker.sync_from(learner) if rank == 0 else drain(learner.named_hf_buckets())
        else:
            metrics["train/skipped_empty_batch"] = 1.0
            log.warning("step %d: no group passed the filters; no update", step)
        state.step, state.data_position = step, _broadcast(stream.position)
        # 3. held-out evaluation, metrics, checkpoint.
        if rank == 0:
            if held_out and (step == tc.steps or (tc.eval_every and step % tc.eval_every == 0)):
                with _timed(timings, "eval"):
                    metrics |= evaluate(cfg, worker, held_out, rollout_cfg, observe=functools.partial(observer.held_out, step))
            metrics |= {"budget/max_turns": rollout_cfg.max_turns,
                        "budget/max_response_tokens": rollout_cfg.max_response_tokens, "train/lr": learner.lr}
            metrics |= observer.end_step(step, metrics | timings)
            sink.log(step, metrics | timings | {"time/unix": time.time()})
        # The checkpoint covers this step's metrics line; its save time is logged with the next step.
        pending_ckpt_s = None
        stopping, time_due = agreed(stop is not None and stop.received is not None,
                                    tc.checkpoint.minutes > 0 and time.monotonic() - last_save >= 60 * tc.checkpoint.minutes)
        if stopping or time_due or step == tc.steps or (tc.checkpoint.every and step % tc.checkpoint.every == 0):
            t0 = time.perf_counter()
            if rank == 0:
                state.metrics_offset = sink.offset
            ckpts.save({POLICY: learner} | ({CRITIC: critic} if critic is not None else {}), state)
            pending_ckpt_s, last_save = time.perf_counter() - t0, time.monotonic()
        if stopping:
            log.warning("stopped after step %d on a signal; the run continues from its checkpoint (--resume)", step)
            break
    if sink is not None:
        observer.close()
        sink.close()
    return state


async def _sample_round(worker, stream: PromptStream, n: int, rollout_cfg, progress: bool):
    start = stream.position  # group ids are positions in the prompt stream
    return await worker.arollout(stream.take(n), rollout_cfg, group_id_offset=start, progress=progress)


def update_policy(cfg: TrainConfig, rt: RolloutTensors, learner, timings: dict, temperature: float,
                  reference=None, *, critic=None, critic_only: bool = False) -> dict:
    """Old log-probs, advantages and masks, then PPO epochs over mini-batches; the train metrics.
    With a ``critic``: GAE advantages from its values and a critic step before each policy step
    (``critic_only``: the critic's warm-up, no policy step)."""
    tc = cfg.trainer
    with _timed(timings, "logprobs"):
        if tc.ppo.old_logprobs == "learner":
            old_BT = learner.logprobs(rt.tokens_BT, rt.attention_mask_BT, temperature=temperature)
        else:
            old_BT = rt.engine_logprobs_BT
        ref_BT = None if reference is None else reference.logprobs(rt.tokens_BT, rt.attention_mask_BT,
                                                                   temperature=temperature)
    update = build_update(rt, old_BT, mode=tc.mode, advantage=None if critic is not None else tc.ppo.advantage,
                          overlong=tc.filters.overlong, low_prob_fraction=tc.filters.low_prob_fraction, ref_logprobs_BT=ref_BT)
    critic_metrics: dict[str, float] = {}
    if critic is not None and update.batch.tokens_BT.shape[0]:
        rows = update.rows_B
        with _timed(timings, "values"):
            update.batch, critic_metrics = gae_advantages(
                update.batch, rt.rewards_B[rows], critic, cfg.critic, model_mask_BT=rt.loss_mask_BT[rows],
                behaviour_BT=old_BT[rows], ref_BT=None if ref_BT is None else ref_BT[rows])
    critic_steps: list[dict[str, float]] = []
    bound = tc.filters.high_ratio_bound if MODES[tc.mode].high_ratio_filter else None
    loss_fn = TurnProbe(PolicyLoss(tc.loss, high_ratio_bound=bound), n_turns=int(rt.turn_index_BT.max()) + 1)
    token_loss = TokenLoss(token_loss=loss_fn, temperature=temperature, with_entropy=True)  # entropy: a diagnostic
    results = []
    with _timed(timings, "train"):
        if update.batch.tokens_BT.shape[0]:
            n_opt = tc.ppo.epochs * min(tc.ppo.mini_batches, len(update.group_of_row.unique()))
            with _phase_bar(tc.progress, "update", n_opt) as bar:
                for _ in range(tc.ppo.epochs):
                    for mb in mini_batches(update, tc.ppo.mini_batches):
                        if critic is not None:
                            critic_steps.append(critic_step(critic, mb, cfg.critic, tc.loss.aggregation))
                        if not critic_only:
                            results.append(learner.train_step(mb, token_loss, aggregation=tc.loss.aggregation))
                        bar.update(1)
    max_ratio = loss_fn.loss_fn.max_ratio_tensor  # on the loss's device: the group's backend needs it there
    if max_ratio is None:
        max_ratio = torch.zeros((), device=collective_device())
    torch.distributed.all_reduce(max_ratio, op=torch.distributed.ReduceOp.MAX)
    out = {
        "filter/rows": float(rt.tokens_BT.shape[0]),
        "filter/rows_void": float(rt.void_B.sum()),
        "filter/rows_infra": float(rt.infra_B.sum()),
        "filter/rows_truncated": float(rt.truncated_B.sum()),
        "filter/rows_in_stats": float(update.stats_B.sum()),
        "filter/rows_in_loss": float(update.batch.tokens_BT.shape[0]),
        "filter/low_prob_tokens_masked": float(update.low_prob_masked),
        "train/advantage_abs_mean": float(update.advantages_B.abs().mean()),
        "train/optimizer_steps": float(len(results)),
        "train/skipped_steps": float(sum(r.skipped for r in results)),
        "train/max_ratio": float(max_ratio),
        "train/tokens": float(update.batch.attention_mask_BT.sum()) * tc.ppo.epochs,
    } | weight_version_metrics(rt.versions_BT, rt.loss_mask_BT) | critic_metrics
    if critic_steps:
        out |= {k: sum(s[k] for s in critic_steps) / len(critic_steps) for k in critic_steps[0]}
        out["critic/warmup"] = float(critic_only)
    if results:
        out["train/loss"] = sum(r.loss for r in results) / len(results)
        out["train/grad_norm"] = sum(r.grad_norm for r in results) / len(results)
        out["train/padding_share"] = sum(r.padding_share for r in results) / len(results)
        means = {key: sum(r.metrics[key] for r in results) / len(results) for key in results[0].metrics}
        out |= {f"train/{k}": v for k, v in loss_fn.finish(means).items()}
    return out


def evaluate(cfg: TrainConfig, worker, problems, rollout_cfg, observe=None) -> dict[str, float]:
    """Held-out reward and TIR behaviour with the current weights (rank 0); ``observe(groups)`` sees the groups."""
    T = cfg.data.eval_temperature if cfg.data.eval_temperature is not None else rollout_cfg.temperature
    top_p = cfg.data.eval_top_p if cfg.data.eval_top_p is not None else rollout_cfg.top_p
    ecfg = dataclasses.replace(rollout_cfg, n_samples=cfg.data.eval_samples, temperature=T, top_p=top_p,
                               seed=cfg.trainer.seed + 1)
    t0 = time.perf_counter()
    groups = worker.rollout(problems, ecfg, group_id_offset=0, progress=cfg.trainer.progress, desc="eval")
    if observe is not None:
        observe(groups)
    return rollout_metrics(groups, prefix="eval") | {"time/eval": time.perf_counter() - t0}


def _phase_bar(progress: bool, desc: str, total: int):
    """A progress bar of optimizer steps on rank 0 when ``progress`` and stderr is a terminal."""
    from tqdm import tqdm

    show = progress and torch.distributed.get_rank() == 0
    return tqdm(total=total, desc=desc, unit="step", leave=False, disable=None if show else True)


def _pad_id(tokenizer) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    assert pad is not None, "the tokenizer has neither a pad nor an EOS token"
    return int(pad)

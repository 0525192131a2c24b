"""Supervised fine-tuning on multi-turn TIR trajectories, through the RL learner. Every rank runs ``run_sft``.

    trajectories (megatron_tir.sft.examples) -> rows of the step (a seeded order, epoch by epoch) ->
    one ``Learner.train_step`` with ``NLLLoss`` (megatron_tir.policy.losses) -> metrics line -> run checkpoint

The loss mask of a row is the rollout's: 0 on the prompt and on feedback (tool output), 1 on the
tokens the model wrote, the same ``[B, T]`` layout as the RL update's (``rollout.batch.collate``:
column ``t`` is token ``t``, its log-prob given the tokens before it). The learner's aggregation,
micro-batches, TP / PP / DP, gradient clipping and non-finite checks are the RL step's; the run's
checkpoints are the trainer's (``RunCheckpoints``: a ``policy`` learner and a ``TrainerState``
whose ``data_position`` counts the rows read), so the run directory is a model for ``train`` and
``eval`` (``--set model=RUN_DIR``) and ``--resume`` continues the same data order.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from megatron_tir.observe.log_file import run_log_file
from megatron_tir.policy.checkpoint.layout import POLICY
from megatron_tir.policy.learner_contract import TrainBatch
from megatron_tir.sft.config import SFTConfig
from megatron_tir.sft.examples import Example
from megatron_tir.train.checkpoint import RunCheckpoints, TrainerState

log = logging.getLogger("megatron_tir.sft")


def fit_examples(examples: Sequence[Example], max_tokens: int) -> tuple[list[Example], int, int]:
    """``(examples cut to max_tokens, rows cut, rows dropped)``: a row whose cut leaves no model token is dropped."""
    out, cut, dropped = [], 0, 0
    for e in examples:
        if e.length > max_tokens:
            keep = max_tokens - len(e.prompt_ids)
            if keep <= 0 or not any(e.loss_mask[:keep]):
                dropped += 1
                continue
            e = Example(prompt_ids=e.prompt_ids, response_ids=e.response_ids[:keep], loss_mask=e.loss_mask[:keep],
                        where=e.where)
            cut += 1
        elif not any(e.loss_mask):
            dropped += 1
            continue
        out.append(e)
    return out, cut, dropped


def sft_batch(examples: Sequence[Example]) -> TrainBatch:
    """The rows right-padded: tokens, attention mask, loss mask 1 on the model's tokens only."""
    T = max(e.length for e in examples)
    tokens = torch.zeros(len(examples), T, dtype=torch.long)
    attn = torch.zeros(len(examples), T, dtype=torch.bool)
    loss = torch.zeros(len(examples), T, dtype=torch.float32)
    for b, e in enumerate(examples):
        p, n = len(e.prompt_ids), e.length
        tokens[b, :n] = torch.tensor(e.prompt_ids + e.response_ids, dtype=torch.long)
        attn[b, :n] = True
        loss[b, p:n] = torch.tensor(e.loss_mask, dtype=torch.float32)
    return TrainBatch(tokens_BT=tokens, attention_mask_BT=attn, loss_mask_BT=loss)


class DataOrder:
    """Row ``position`` of the run's stream: epoch ``position // n`` in a fresh seeded permutation (a pure
    function of the position, so a resume continues it)."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed = n, seed
        self._epoch: tuple[int, list[int]] | None = None

    def __getitem__(self, position: int) -> int:
        epoch, offset = divmod(position, self.n)
        if self._epoch is None or self._epoch[0] != epoch:
            order = list(range(self.n))
            random.Random(f"{self.seed}/{epoch}").shuffle(order)
            self._epoch = (epoch, order)
        return self._epoch[1][offset]

    def take(self, position: int, count: int) -> list[int]:
        return [self[p] for p in range(position, position + count)]


def run_sft(cfg: SFTConfig, run_dir: Path, state: TrainerState, *, resume: bool) -> TrainerState:
    """Every rank calls this with the same arguments; returns the final state."""
    from megatron_tir.policy.learner import Learner
    from megatron_tir.policy.parallel import destroy_parallel, init_parallel

    examples, cut, dropped = load_data(cfg)  # bad data is refused before the process group and the model
    torch.manual_seed(cfg.seed)
    init_parallel(cfg.learner.tp, cfg.learner.pp, seed=cfg.learner.seed, ep=cfg.learner.ep,
                  timeout_s=cfg.collective_timeout_s, model_parallel_timeout_s=cfg.collective_timeout_s)
    try:
        with run_log_file(run_dir, rank0=torch.distributed.get_rank() == 0):  # the learner's start-up line included
            learner = Learner(cfg.learner)
            log.info("sft data: %d trajectories (%d model tokens, %d feedback tokens) from %d file(s); %d cut to "
                     "max_tokens=%d, %d dropped (no model token left)", len(examples),
                     sum(e.model_tokens for e in examples), sum(len(e.loss_mask) - e.model_tokens for e in examples),
                     len(cfg.data), cut, cfg.max_tokens, dropped)
            ckpts = RunCheckpoints(run_dir, keep_last=cfg.checkpoint.keep_last)
            if resume:
                loaded = ckpts.load({POLICY: learner}, strict=cfg.checkpoint.strict_resume,
                                    allow_unverified=cfg.checkpoint.allow_unverified)
                state.step, state.data_position, state.metrics_offset = loaded.step, loaded.data_position, \
                    loaded.metrics_offset
                log.info("resumed %s at step %d (row %d)", run_dir, state.step, state.data_position)
            return _loop(cfg, run_dir, state, learner, examples, ckpts)
    finally:
        destroy_parallel()


def load_data(cfg: SFTConfig) -> tuple[list[Example], int, int]:
    """``cfg.data``'s examples cut to ``max_tokens`` (:func:`fit_examples`), tokenized with the model's
    tokenizer (its HF files: no weights are read); ValueError naming the file and row on bad input."""
    from transformers import AutoTokenizer

    from megatron_tir.policy.model_source import resolve_source
    from megatron_tir.sft.examples import load_examples

    tokenizer = AutoTokenizer.from_pretrained(resolve_source(cfg.learner.model).hf_files)
    examples, cut, dropped = fit_examples(
        load_examples(cfg.data, tokenizer, cfg.rollout, only_correct=cfg.only_correct), cfg.max_tokens)
    if not examples:
        raise ValueError(f"no trajectory has a model token within max_tokens={cfg.max_tokens}")
    return examples, cut, dropped


def _loop(cfg: SFTConfig, run_dir: Path, state: TrainerState, learner, examples: list[Example],
          ckpts: RunCheckpoints) -> TrainerState:
    from megatron_tir.observe.trackers import open_trackers
    from megatron_tir.policy.losses import NLLLoss
    from megatron_tir.train.metrics import open_metrics
    from megatron_tir.train.preempt import agreed

    rank0 = torch.distributed.get_rank() == 0
    if rank0:
        (run_dir / "config.json").write_text(json.dumps(state.config, indent=1))
    sink = open_metrics(run_dir, truncate_to=state.metrics_offset,
                        trackers=lambda: open_trackers(cfg.log, run_dir, state.config,
                                                       purge_step=state.step + 1 if state.step else 0))
    order, loss_fn = DataOrder(len(examples), cfg.seed), NLLLoss()
    last_save = time.monotonic()
    try:
        for step in range(state.step + 1, cfg.steps + 1):
            t0 = time.perf_counter()
            rows = [examples[i] for i in order.take(state.data_position, cfg.rows_per_step)]
            result = learner.train_step(sft_batch(rows), loss_fn, aggregation=cfg.aggregation)
            state.step, state.data_position = step, state.data_position + len(rows)
            tokens = sum(e.model_tokens for e in rows)
            metrics = {"train/loss": result.loss, "train/grad_norm": result.grad_norm, "train/lr": result.lr,
                       "train/skipped_steps": float(result.skipped), "train/padding_share": result.padding_share,
                       "train/rows": float(len(rows)), "train/tokens": float(tokens),
                       "train/feedback_tokens": float(sum(len(e.loss_mask) for e in rows) - tokens),
                       "train/epoch": state.data_position / len(examples),
                       "time/train": result.timings["total"], "time/step": time.perf_counter() - t0,
                       "time/unix": time.time()}
            sink.log(step, metrics)
            log.info("sft step %d/%d | loss %.4f | grad %.3g | lr %.3g | rows %d (%d model tokens) | epoch %.2f | "
                     "%.1f s%s", step, cfg.steps, result.loss, result.grad_norm, result.lr, len(rows), tokens,
                     metrics["train/epoch"], metrics["time/step"], " | SKIPPED (non-finite gradients)"
                     if result.skipped else "")
            every, minutes = cfg.checkpoint.every, cfg.checkpoint.minutes
            (time_due,) = agreed(minutes > 0 and time.monotonic() - last_save >= 60 * minutes)
            if time_due or step == cfg.steps or (every and step % every == 0):
                state.metrics_offset = sink.offset
                ckpts.save({POLICY: learner}, state)
                last_save = time.monotonic()
    finally:
        sink.close()
    if rank0 and cfg.plots:
        from megatron_tir.observe.plots import plot_runs

        plot_runs([run_dir])
    return state

"""Rank 0's observer of a training run: the per-step line, rollout dumps, sample tables, step-level diagnostics.

The loop calls it at three points of a step (``sampled`` after the rollouts, ``held_out``
after an evaluation, ``end_step`` before the metrics are logged).
The evaluation before training (step 0) logs its ``step 0 | held-out ...`` line as soon as it ends
(its seconds counted from the observer's start, which is just before that evaluation).
``end_step`` adds ``time/step`` (wall seconds since the previous step ended), the grad-norm
spike flag and moving average (:class:`~megatron_tir.observe.diagnostics.GradNormSpikes`),
``perf/generation_tokens_per_s`` (model tokens sampled / rollout seconds) and
``perf/train_tokens_per_s`` (tokens through forward+backward / train seconds), logs the
step line (:mod:`megatron_tir.observe.step_line`) at INFO, writes the step's dump when due
and hands a few rendered trajectories to the trackers. Its lines reach ``RUN_DIR/train.log`` through the
run's log file (:mod:`megatron_tir.observe.log_file`, attached before the learner is built).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from megatron_tir.observe.diagnostics import GradNormSpikes
from megatron_tir.observe.dumps import dump_path, step_records, update_records, write_dump
from megatron_tir.observe.show import render
from megatron_tir.observe.step_line import format_held_out_line, format_step_line
from megatron_tir.rl import MODES

log = logging.getLogger("megatron_tir.steps")


class StepObserver:
    def __init__(self, cfg, run_dir: Path, *, tokenizer, sink) -> None:
        self.cfg, self.run_dir, self.tokenizer, self.sink = cfg, Path(run_dir), tokenizer, sink
        self.log_cfg = cfg.trainer.log
        self.spikes = GradNormSpikes(window=self.log_cfg.moving_average, factor=self.log_cfg.spike_factor,
                                     min_history=min(3, self.log_cfg.moving_average))
        self._records: list[dict] = []
        self._gen_tokens = 0
        self._t_end = time.perf_counter()

    def sampled(self, step: int, sampled, fates) -> None:
        """After the step's rollouts: every group it sampled and what the step decided for each row
        (``(group_id, sample_index) ->`` :class:`~megatron_tir.rollout.batch.RowFate`, rank 0's producer)."""
        self._gen_tokens = sum(t.num_model_tokens for g in sampled for t in g.trajectories)
        if not self.log_cfg.dump_due(step):
            return
        tc = self.cfg.trainer
        records = update_records(sampled, fates, drop_void=MODES[tc.mode].drop_void, overlong=tc.filters.overlong)
        self._records += step_records(step, "train", sampled, self.tokenizer,
                                      include_ids=self.log_cfg.dump_tokens, fates=records)

    def held_out(self, step: int, groups, metrics: dict) -> None:
        """After a held-out evaluation: its groups and its metrics (``eval/*``, ``time/eval``)."""
        if self.log_cfg.dump_due(step) or (step == 0 and self.log_cfg.dump_every):
            self._records += step_records(step, "eval", groups, self.tokenizer, include_ids=self.log_cfg.dump_tokens)
        if step == 0:  # the evaluation before training: its line now, its own dump; step 1's clock starts after it
            log.info("%s", format_held_out_line(0, metrics))
            self.flush(0)
            self._t_end = time.perf_counter()

    def end_step(self, step: int, metrics: dict) -> dict[str, float]:
        """The step-level diagnostics to add to ``metrics``; logs the step line, writes the dump."""
        now = time.perf_counter()
        extra = {"time/step": now - self._t_end}
        self._t_end = now
        grad = metrics.get("train/grad_norm")
        if isinstance(grad, float):
            extra |= self.spikes.update(grad)
        if metrics.get("time/rollout"):
            extra["perf/generation_tokens_per_s"] = self._gen_tokens / metrics["time/rollout"]
        if metrics.get("time/train") and metrics.get("train/tokens"):
            extra["perf/train_tokens_per_s"] = metrics["train/tokens"] / metrics["time/train"]
        if step > 0:
            log.info("%s", format_step_line(step, self.cfg.trainer.steps, metrics | extra))
        self.flush(step)
        return extra

    def flush(self, step: int) -> None:
        """Write the buffered records of ``step`` as its dump and show a few to the trackers."""
        if not self._records:
            return
        records, self._records = self._records, []
        path = dump_path(self.run_dir, step)
        write_dump(path, records)
        log.debug("step %d: %d trajectories dumped to %s", step, len(records), path)
        n = self.log_cfg.text_samples
        for split in ("train", "eval"):
            picked = [r for r in records if r["split"] == split][:n]
            rows = [{"split": split, "group": r["group_id"], "sample": r["sample_index"], "status": r["status"],
                     "reward": r["reward"], "in_loss": (r.get("update") or {}).get("in_loss"),
                     "dropped_by": (r.get("update") or {}).get("dropped_by"), "text": render(r)} for r in picked]
            if rows:
                self.sink.log_samples(step, f"rollouts/{split}", rows)

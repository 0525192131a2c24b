"""The rank-0 observer's step-level diagnostics: tokens/s, the spike flag, the step line in the log file."""

from __future__ import annotations

import logging

import pytest
from observe_crafted import answer_turn, make

from megatron_tir.observe.config import LogConfig
from megatron_tir.observe.log_file import LOG_FILE, run_log_file
from megatron_tir.observe.run_log import StepObserver
from megatron_tir.rollout.batch import Group
from megatron_tir.train.config import TrainConfig


def test_tokens_per_second_spike_flag_and_the_line_in_train_log(tmp_path):
    cfg = TrainConfig()
    cfg.trainer.log = LogConfig(dump_every=0, moving_average=2, spike_factor=2.0)
    logging.getLogger().setLevel(logging.INFO)
    obs = StepObserver(cfg, tmp_path, tokenizer=None, sink=None)
    with run_log_file(tmp_path, rank0=True):  # rank 0's log file (train attaches it before the learner)
        g = Group(group_id=0, problem=None, trajectories=[
            make([answer_turn(0, "a", "1")], logprobs_per_turn=[[-1.0] * 30]),
            make([answer_turn(0, "b", "1")], logprobs_per_turn=[[-1.0] * 10], sample=1)])
        for step, grad in ((1, 1.0), (2, 1.0), (3, 1.0), (4, 5.0)):
            obs.sampled(step, [g], {})
            extra = obs.end_step(step, {"time/rollout": 4.0, "time/train": 2.0, "train/tokens": 300.0,
                                        "train/grad_norm": grad})
        assert extra["perf/generation_tokens_per_s"] == pytest.approx(40 / 4.0)  # 30 + 10 model tokens in 4 s
        assert extra["perf/train_tokens_per_s"] == pytest.approx(150.0)
        assert extra["train/grad_norm_spike"] == 1.0 and extra["train/grad_norm_ma"] == 1.0
        assert extra["time/step"] >= 0
    lines = [x for x in (tmp_path / LOG_FILE).read_text().splitlines() if "megatron_tir.steps" in x]
    assert len(lines) == 4 and "step 4/10 | grad 5 SPIKE | " in lines[-1] and "SPIKE" not in lines[-2]

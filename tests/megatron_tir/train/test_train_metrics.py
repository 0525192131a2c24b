"""Rollout metrics of crafted groups, the metrics sink (JSONL + TensorBoard), plot, the turn schedule."""

from __future__ import annotations

import json

import pytest
from crafted_rollouts import C, F, V, group

from megatron_tir.rollout.trajectory import Turn
from megatron_tir.tir.markup import TurnKind
from megatron_tir.rollout.engines.base import FinishReason
from megatron_tir.observe.metrics_file import read_metrics
from megatron_tir.observe.plots import plot_runs
from megatron_tir.train.metrics import MetricsSink, rollout_metrics
from megatron_tir.train.turn_schedule import TurnScheduleConfig, plateaued, schedule_due


def test_rollout_metrics_of_crafted_groups():
    g = group(0, (C, 1.0, (-1.0, -3.0)), (V, 0.0, (-2.0,)), (C, 0.0), (F, 0.0))
    t0 = g.trajectories[0]
    t0.turns = [Turn(index=0, kind=TurnKind.ANSWER, reason="", finish_reason=FinishReason.EOS, start=0, model_tokens=1),
                Turn(index=1, kind=TurnKind.ANSWER, reason="", finish_reason=FinishReason.EOS, start=1, model_tokens=1)]
    g.trajectories[1].turns = [Turn(index=0, kind=TurnKind.VOID, reason="", finish_reason=FinishReason.EOS, start=0,
                                    model_tokens=1)]
    m = rollout_metrics([g])
    assert m["rollout/reward"] == 0.25 and m["rollout/void_trajectory_ratio"] == 0.25
    assert m["rollout/void_turn_share"] == pytest.approx(1 / 3)  # 1 void turn of 3 turns
    assert m["rollout/logprob_turn_0"] == pytest.approx((-1.0 - 2.0) / 2)  # turn 0 of rows 0 and 1
    assert m["rollout/logprob_turn_1"] == pytest.approx(-3.0)
    assert m["rollout/status_tool_failed"] == 1.0


def test_sink_writes_jsonl_tensorboard_and_truncates_on_resume(tmp_path):
    sink = MetricsSink(tmp_path)
    sink.log(1, {"train/loss": 0.5, "rollout/reward": 0.25, "x": float("nan")})
    offset = sink.offset
    sink.log(2, {"train/loss": 0.4, "rollout/reward": 0.5})
    sink.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    assert read_metrics(tmp_path)[0]["x"] is None
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    MetricsSink(tmp_path, truncate_to=offset).close()  # a resume from the step-1 checkpoint
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]
    written = plot_runs([tmp_path])
    assert {p.name for p in written} >= {"reward.png", "loss.png", "dashboard.png"}
    assert all(p.stat().st_size > 1000 for p in written)


def test_plot_of_a_non_run_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="metrics.jsonl"):
        plot_runs([tmp_path])


def test_plateau_and_schedule():
    assert not plateaued([100, 200, 300], window=2, tolerance=0.05)
    assert plateaued([100, 200, 300, 302, 299, 301], window=2, tolerance=0.05)
    assert not plateaued([100, 200, 300, 350], window=2, tolerance=0.05)
    cfg = TurnScheduleConfig(at_step=5)
    assert not schedule_due(4, cfg, []) and schedule_due(5, cfg, [])
    cfg = TurnScheduleConfig(on_plateau=True, plateau_window=2, plateau_tolerance=0.05)
    assert schedule_due(7, cfg, [100, 200, 300, 302, 299, 301]) and not schedule_due(7, cfg, [1, 2, 3, 4])


def test_held_out_summary_lists_each_evaluation(tmp_path):
    from megatron_tir.train.cli import held_out_summary

    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 0, "eval/reward": 0.25, "eval/code_use_ratio": 0.5},
            {"step": 1, "rollout/reward": 0.5},
            {"step": 2, "eval/reward": 0.75}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert held_out_summary(path) == ["held-out at step 0: reward 0.250, code_use_ratio 0.500",
                                      "held-out at step 2: reward 0.750, code_use_ratio nan"]


def test_rollout_metrics_report_the_reward_of_each_source_of_a_mix():
    a = group(0, (C, 1.0), (C, 0.0))
    b = group(1, (C, 0.0), (V, 0.0))
    for t in a.trajectories:
        t.data_source = "arithmetic"
    for t in b.trajectories:
        t.data_source = "base_conversion"
    m = rollout_metrics([a, b], prefix="eval")
    assert m["eval/reward_by_source/arithmetic"] == 0.5
    assert m["eval/reward_by_source/base_conversion"] == 0.0
    assert not any("reward_by_source" in k for k in rollout_metrics([a]))  # one source: the overall reward says it

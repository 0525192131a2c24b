"""The per-step line: fields from the step's metrics, plain text."""

from __future__ import annotations

from megatron_tir.observe.step_line import format_step_line


def test_step_line_fields():
    m = {"rollout/reward": 0.25, "eval/reward": 0.3125, "rollout/void_trajectory_ratio": 0.19,
         "rollout/mean_response_tokens": 212.4, "rollout/response_tokens_max": 256, "filter/rows": 32.0,
         "filter/rows_in_loss": 24.0, "train/grad_norm": 0.84, "train/grad_norm_spike": 1.0, "time/step": 41.2,
         "time/rollout": 30.1, "time/train": 6.0, "time/eval": float("nan")}
    line = format_step_line(3, 10, m)
    assert line == ("step 3/10 | reward 0.250 | held-out 0.312 | void 19% | resp tokens 212 mean, 256 max | "
                    "rows 24/32 in loss | grad 0.84 SPIKE | 41.2 s (rollout 30.1, train 6.0)")
    assert format_step_line(1, 2, {"train/skipped_empty_batch": 1.0}) == \
        "step 1/2 | no update (no group passed the filters)"
    assert "\x1b" not in line and "\r" not in line


def test_held_out_line_of_the_evaluation_before_training():
    from megatron_tir.observe.step_line import format_held_out_line

    line = format_held_out_line(0, {"eval/reward": 0.1071, "eval/code_use_ratio": 0.8234,
                                    "eval/void_trajectory_ratio": 0.04, "eval/mean_response_tokens": 180.4,
                                    "time/eval": 35.24, "rollout/reward": 0.9})
    assert line == "step 0 | held-out 0.107 | code use 0.82 | void 4% | resp tokens 180 mean | 35.2 s (eval)"
    assert format_held_out_line(0, {"eval/reward": float("nan")}) == "step 0"

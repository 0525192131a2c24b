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

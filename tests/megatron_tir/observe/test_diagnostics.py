"""Rollout diagnostics on crafted trajectories against hand-computed values."""

from __future__ import annotations

import math

import pytest
from observe_crafted import answer_turn, code_turn, make, void_turn

from megatron_tir.observe.diagnostics import (
    GradNormSpikes,
    length_stats,
    percentile,
    termination_rates,
    turn_token_stats,
    void_reason_slug,
    void_reasons,
)
from megatron_tir.rollout.engines.base import FinishReason
from megatron_tir.rollout.trajectory import FinishStatus
from megatron_tir.train.metrics import rollout_metrics
from megatron_tir.rollout.batch import Group


def test_per_turn_min_logprob_and_low_probability_share():
    low = math.log(1e-4)  # p = 1e-4 < 1e-3
    a = make([code_turn(0, "x = 1"), answer_turn(1, "\\boxed{1}", "1")],
             logprobs_per_turn=[[-0.1, low, -2.0], [-0.3, -0.2]])
    b = make([code_turn(0, "y = 2")], logprobs_per_turn=[[-1.0, math.log(2e-3)]], status=FinishStatus.MAX_TURNS)
    m = turn_token_stats([a, b])
    assert m["logprob_min_turn_0"] == pytest.approx(low)
    assert m["low_prob_share_turn_0"] == pytest.approx(1 / 5)  # 5 tokens in turn 0, one below 1e-3 (2e-3 is not)
    assert m["logprob_min_turn_1"] == pytest.approx(-0.3) and m["low_prob_share_turn_1"] == 0.0


def test_length_percentiles_budget_hits_and_termination_rates():
    trajs = [make([answer_turn(0, "a", "1")], logprobs_per_turn=[[-1.0] * n], status=s)
             for n, s in ((2, FinishStatus.COMPLETED), (4, FinishStatus.TRUNCATED), (6, FinishStatus.MAX_TURNS),
                          (8, FinishStatus.VOID), (10, FinishStatus.TOOL_FAILED))]
    trajs[3].turns[0].finish_reason = FinishReason.LENGTH  # a void turn cut by the budget
    m = length_stats(trajs)
    # response tokens: 2, 4, 6, 8, 10 (answer turns carry no feedback); nearest rank p50 = 6, p90 = 10
    assert (m["response_tokens_min"], m["response_tokens_p50"], m["response_tokens_p90"],
            m["response_tokens_max"]) == (2, 6, 10, 10)
    assert m["budget_hit_share"] == pytest.approx(2 / 5)  # the truncated one and the length-cut void one
    r = termination_rates(trajs)
    assert r == {"natural_termination_rate": pytest.approx(2 / 5), "truncation_rate": pytest.approx(1 / 5),
                 "max_turns_reached_rate": pytest.approx(1 / 5)}
    assert percentile([3, 1, 2, 4], 50) == 2 and percentile([5], 90) == 5


def test_void_counts_by_reason():
    trajs = [make([void_turn(0, "```python\nx=")], status=FinishStatus.VOID,
                  void_reason="length cut inside a code block (partial code)") for _ in range(2)]
    trajs.append(make([void_turn(0, "blah")], status=FinishStatus.VOID, void_reason="EOS without code or answer"))
    trajs.append(make([answer_turn(0, "\\boxed{1}", "1")]))
    assert void_reasons(trajs) == {"void_reason/length_cut_inside_a_code_block": 2.0,
                                   "void_reason/eos_without_code_or_answer": 1.0}
    assert void_reason_slug(None) == "unknown"


def test_grad_norm_spike_flag_against_its_moving_average():
    s = GradNormSpikes(window=3, factor=3.0, min_history=2)
    assert s.update(1.0) == {} and s.update(2.0) == {}
    assert s.update(4.4) == {"train/grad_norm_ma": 1.5, "train/grad_norm_spike": 0.0}  # 4.4 < 3 * 1.5
    out = s.update(30.0)  # window now 1, 2, 4.4: mean 2.4667
    assert out["train/grad_norm_ma"] == pytest.approx(7.4 / 3) and out["train/grad_norm_spike"] == 1.0
    s.update(float("nan"))  # a skipped step does not enter the window
    assert s.update(1.0)["train/grad_norm_ma"] == pytest.approx((2.0 + 4.4 + 30.0) / 3)


def test_rollout_metrics_carry_the_diagnostics_with_their_prefix():
    g = Group(group_id=0, problem=None, trajectories=[make([answer_turn(0, "\\boxed{1}", "1")], final_answer="1")])
    m = rollout_metrics([g], prefix="eval")
    for key in ("eval/logprob_min_turn_0", "eval/response_tokens_p90", "eval/natural_termination_rate",
                "eval/avg_repeat_score", "eval/code_proportion", "eval/pattern_cross_checking"):
        assert key in m

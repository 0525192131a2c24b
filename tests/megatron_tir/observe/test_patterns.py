"""The three reasoning patterns on crafted trajectories (positive and negative cases)."""

from __future__ import annotations

import math

import pytest
from observe_crafted import answer_turn, code_turn, make

from megatron_tir.observe.patterns import cross_checking, error_correction, pattern_rates, progressive_reasoning
from sandbox_cluster.protocol import Status


def test_error_correction():
    fixed = make([code_turn(0, "print(1/0)", stderr="ZeroDivisionError", status=Status.ERROR),
                  code_turn(1, "print(1/2)", stdout="0.5\n"), answer_turn(2, "\\boxed{0.5}", "0.5")])
    assert error_correction(fixed)
    never_failed = make([code_turn(0, "print(2)", stdout="2\n"), answer_turn(1, "\\boxed{2}", "2")])
    failed_last = make([code_turn(0, "print(2)", stdout="2\n"),
                        code_turn(1, "print(x)", stderr="NameError", status=Status.ERROR)])
    infra_then_ok = make([code_turn(0, "print(3)", status=Status.SANDBOX_ERROR), code_turn(1, "print(3)", stdout="3")])
    assert not error_correction(never_failed) and not error_correction(failed_last)
    assert not error_correction(infra_then_ok)  # an infrastructure failure is not the model's error


def test_progressive_reasoning():
    by_name = make([code_turn(0, "n = 12\nprint(n)", stdout="12\n"), code_turn(1, "print(n * 2)", stdout="24\n")])
    by_printed_value = make([code_turn(0, "print(3 * 41)", stdout="123\n"), code_turn(1, "print(123 + 1)")])
    unrelated = make([code_turn(0, "a = 5\nprint(a)", stdout="5\n"), code_turn(1, "print(7 + 1)", stdout="8\n")])
    single = make([code_turn(0, "n = 1\nprint(n)", stdout="1\n")])
    assert progressive_reasoning(by_name) and progressive_reasoning(by_printed_value)
    assert not progressive_reasoning(unrelated)  # 5 is one character: ordinary constants do not count
    assert not progressive_reasoning(single)


def test_cross_checking():
    after_answer = make([code_turn(0, "print(6*7)", stdout="42\n", prose="The answer is \\boxed{42}. Check:\n")],
                        final_answer="42")
    two_agree = make([code_turn(0, "print(6*7)", stdout="42\n"), code_turn(1, "print(84//2)", stdout="42\n"),
                      answer_turn(2, "\\boxed{42}", "42")], final_answer="42")
    one_run = make([code_turn(0, "print(6*7)", stdout="42\n"), answer_turn(1, "\\boxed{42}", "42")], final_answer="42")
    disagree = make([code_turn(0, "print(6*7)", stdout="42\n"), code_turn(1, "print(420)", stdout="420\n"),
                     answer_turn(2, "\\boxed{42}", "42")], final_answer="42")
    assert cross_checking(after_answer) and cross_checking(two_agree)
    assert not cross_checking(one_run) and not cross_checking(disagree)  # "420" does not contain the token 42


def test_rates_count_correct_trajectories_only():
    fixed = make([code_turn(0, "print(1/0)", stderr="E", status=Status.ERROR), code_turn(1, "print(2)", stdout="2")],
                 reward=1.0)
    plain = make([answer_turn(0, "\\boxed{2}", "2")], reward=1.0)
    wrong_fixed = make([code_turn(0, "print(1/0)", stderr="E", status=Status.ERROR), code_turn(1, "print(3)")],
                       reward=0.0)
    r = pattern_rates([fixed, plain, wrong_fixed])
    assert r["pattern_error_correction"] == pytest.approx(1 / 2)
    assert r["pattern_progressive_reasoning"] == 0.0 and r["pattern_cross_checking"] == 0.0
    assert all(math.isnan(v) for v in pattern_rates([wrong_fixed]).values())


def test_eval_report_prints_the_pattern_rates():
    from megatron_tir.eval.metrics import compute_metrics
    from megatron_tir.rollout.batch import Group

    fixed = make([code_turn(0, "print(1/0)", stderr="E", status=Status.ERROR), code_turn(1, "print(2)", stdout="2")],
                 reward=1.0, sample=0)
    plain = make([answer_turn(0, "\\boxed{2}", "2")], reward=1.0, sample=1)
    m = compute_metrics([Group(group_id=0, problem=None, trajectories=[fixed, plain])], k=2)
    assert m.diagnostics["pattern_error_correction"] == pytest.approx(0.5)
    assert ("reasoning patterns of correct trajectories: error_correction: 50.0%   progressive_reasoning: 0.0%   "
            "cross_checking: 0.0%") in m.lines()
    assert any(line.startswith("ZeroTIR: avg_repeat_score ") and "code_proportion 50.0%" in line for line in m.lines())

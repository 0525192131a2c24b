"""Metric definitions against hand-computed cases (SimpleTIR's meanings for the shared names)."""

import math

import pytest

from megatron_tir.eval import compute_metrics, pass_at_k
from megatron_tir.eval.metrics import trajectory_metrics
from megatron_tir.rollout import FinishStatus, Group, ToolCall, Trajectory, Turn
from megatron_tir.rollout.engines.base import FinishReason
from megatron_tir.tir import TurnKind
from megatron_tir.rollout.tools.python import INFRA_FAILURES
from sandbox_cluster.protocol import ExecResult, Status

C, A, V, AB = TurnKind.CODE, TurnKind.ANSWER, TurnKind.VOID, TurnKind.ABORTED


def test_pass_at_k_unbiased_estimator_by_hand():
    # n=4, c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    # n=5, c=2, k=3: 1 - C(3,3)/C(5,3) = 1 - 1/10
    assert pass_at_k(5, 2, 3) == pytest.approx(0.9)
    assert pass_at_k(3, 0, 2) == 0.0
    assert pass_at_k(3, 2, 2) == 1.0  # n - c < k: every draw of 2 holds a correct one
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)  # pass@1 = c / n
    with pytest.raises(ValueError):
        pass_at_k(2, 3, 1)
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def T(kind, tool_status=None, stderr=""):
    tool = None
    if tool_status is not None:
        status = Status(tool_status)
        tool = ToolCall(result=ExecResult(id="", status=status, stderr=stderr),
                        infra_error=status.value if status in INFRA_FAILURES else None)
    return Turn(index=0, kind=kind, reason="", finish_reason=FinishReason.STOP, start=0, model_tokens=1,
                code="x" if kind is C else None, tool=tool)


def traj(g, s, reward, status, turns, model=10, feedback=0):
    t = Trajectory(group_id=g, sample_index=s, prompt_ids=[1], status=status, reward=reward, turns=turns)
    t.append_model_tokens([5] * model, [-0.1] * model, [0] * model)
    t.append_feedback_tokens([6] * feedback)
    return t


def test_metrics_by_hand():
    g0 = Group(group_id=0, problem=None, trajectories=[
        # code (ok) then answer, correct
        traj(0, 0, 1.0, FinishStatus.COMPLETED, [T(C, "ok"), T(A)], model=20, feedback=4),
        # answer only, wrong
        traj(0, 1, 0.0, FinishStatus.COMPLETED, [T(A)], model=10),
    ])
    g1 = Group(group_id=1, problem=None, trajectories=[
        # code (error), then void
        traj(1, 0, 0.0, FinishStatus.VOID, [T(C, "error", "Traceback"), T(V)], model=30, feedback=6),
        # answer only, correct
        traj(1, 1, 1.0, FinishStatus.COMPLETED, [T(A)], model=8),
    ])
    m = compute_metrics([g0, g1], k=2)
    assert m.avg_at_k == pytest.approx(0.5)  # (1/2 + 1/2) / 2
    assert m.pass_at_k == pytest.approx(1.0)  # each problem has a correct sample
    x = m.tir
    assert x["num_turns"] == pytest.approx(6 / 4)
    assert x["void_turn_ratio"] == pytest.approx(1 / 4)  # trajectories with a void turn
    assert x["void_trajectory_ratio"] == pytest.approx(1 / 4)
    assert x["void_turn_share"] == pytest.approx(1 / 6)  # 6 turns, 1 void
    assert x["finish_ratio"] == 1.0  # three answers and one void: all ended by the model
    assert x["completed_ratio"] == pytest.approx(3 / 4)
    assert x["num_code_use"] == pytest.approx(2 / 4)
    assert x["code_use_ratio"] == pytest.approx((1 / 2 + 0 + 1 / 2 + 0) / 4)  # per trajectory: code turns / turns
    assert x["num_valid_code"] == pytest.approx(1 / 4)  # the error wrote to stderr
    assert x["valid_code_ratio"] == pytest.approx((1 / 2) / 4)
    assert x["code_trajectory_ratio"] == pytest.approx(2 / 4)
    assert x["exec_ok_ratio"] == pytest.approx(1 / 2)  # ok, error
    assert x["correct_with_code"] == pytest.approx(1 / 2)  # of 2 correct, one used code
    assert x["infra_failure_ratio"] == 0.0
    assert x["mean_response_tokens"] == pytest.approx((24 + 10 + 36 + 8) / 4)
    assert x["mean_model_tokens"] == pytest.approx((20 + 10 + 30 + 8) / 4)
    assert m.status_counts == {"completed": 3, "void": 1}
    # k=1: avg@1 uses the first sample of each problem; pass@1 = c/n averaged
    m1 = compute_metrics([g0, g1], k=1)
    assert m1.avg_at_k == pytest.approx((1.0 + 0.0) / 2)
    assert m1.pass_at_k == pytest.approx((1 / 2 + 1 / 2) / 2)
    assert any(line.startswith("avg@1: 50.0%") for line in m1.lines())


def test_void_turn_ratio_counts_trajectories_not_turns():
    # void_turn="continue": two void turns in one trajectory that then answers
    cont = traj(0, 0, 1.0, FinishStatus.COMPLETED, [T(V), T(V), T(A)])
    clean = traj(0, 1, 1.0, FinishStatus.COMPLETED, [T(C, "ok"), T(A)])
    x = trajectory_metrics([cont, clean])
    assert x["void_turn_ratio"] == 0.5  # SimpleTIR: 1 - mean(void_turn_mask), one mask bit per trajectory
    assert x["void_trajectory_ratio"] == 0.0  # none *ended* void
    assert x["void_turn_share"] == pytest.approx(2 / 5)


def test_infrastructure_outcomes_are_not_void_and_not_finished():
    aborted = traj(0, 0, 0.0, FinishStatus.ABORTED, [T(AB)])
    tool_failed = traj(0, 1, 0.0, FinishStatus.TOOL_FAILED, [T(C, "sandbox_error")])
    x = trajectory_metrics([aborted, tool_failed])
    assert x["void_turn_ratio"] == 0.0 and x["void_turn_share"] == 0.0
    assert x["finish_ratio"] == 0.0 and x["infra_failure_ratio"] == 1.0
    assert math.isnan(x["exec_ok_ratio"])  # an infrastructure failure is not an execution
    assert x["num_valid_code"] == 0.0 and x["num_code_use"] == 0.5


def test_finish_ratio_is_one_minus_the_still_active_share():
    trajs = [
        traj(0, 0, 0.0, FinishStatus.MAX_TURNS, [T(C, "ok")] * 3),  # ran out of turns: still active
        traj(0, 1, 0.0, FinishStatus.TRUNCATED, [T(C, "ok")]),  # ran out of tokens after feedback
        traj(0, 2, 0.0, FinishStatus.TRUNCATED, [T(A)]),  # an answer, then the length limit
        traj(0, 3, 0.0, FinishStatus.VOID, [T(V)]),  # SimpleTIR: a void turn is done too
    ]
    x = trajectory_metrics(trajs)
    assert x["finish_ratio"] == 0.5 and x["completed_ratio"] == 0.0
    assert x["num_turns"] == pytest.approx(6 / 4)
    # valid_code_ratio averages per-trajectory valid/turns: (3/3 + 1/1 + 0 + 0) / 4
    assert x["valid_code_ratio"] == 0.5 and x["code_use_ratio"] == 0.5


def test_nothing_correct_gives_nan_share():
    g = Group(group_id=0, problem=None, trajectories=[traj(0, 0, 0.0, FinishStatus.VOID, [T(V)])])
    m = compute_metrics([g], k=1)
    assert math.isnan(m.tir["correct_with_code"]) and math.isnan(m.tir["exec_ok_ratio"])
    assert any("correct_with_code: n/a" in line for line in m.lines())


def test_metric_errors():
    g = Group(group_id=0, problem=None, trajectories=[traj(0, 0, 1.0, FinishStatus.COMPLETED, [T(A)])])
    with pytest.raises(ValueError, match="fewer than k=2"):
        compute_metrics([g], k=2)
    with pytest.raises(ValueError, match="no groups"):
        compute_metrics([], k=1)
    unscored = Group(group_id=0, problem=None, trajectories=[traj(0, 0, None, FinishStatus.COMPLETED, [T(A)])])
    with pytest.raises(ValueError, match="unscored"):
        compute_metrics([unscored], k=1)

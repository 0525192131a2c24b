"""Evaluation and TIR metrics, defined once (``megatron-tir eval`` and training logs).

Accuracy (per problem with n sampled trajectories, c of them correct; averaged over problems):

* ``avg_at_k`` -- mean reward of the first k samples (k <= n); the paper's avg@k.
* ``pass_at_k`` -- the unbiased estimator 1 - C(n-c, k) / C(n, k) (Chen et al., 2021).

Names shared with SimpleTIR's training logs (``env/*`` in
``recipe/simpletir/simpletir_ray_trainer.py``, ``compute_data_metrics``, from the
per-trajectory counters of ``agent_utils.py``, ``AgentHelper.run_llm_loop``) mean what
they mean there. Per trajectory, ``turns`` is its number of model turns:

* ``num_turns`` -- mean ``turns`` (SimpleTIR ``env/num_turns/mean``, its ``turns_stats``).
* ``finish_ratio`` -- share of trajectories the model ended itself, with a final answer
  (in its text or printed by its code) or a void turn, rather than running out of turns
  or tokens or being stopped by the infrastructure (SimpleTIR ``env/finish_ratio`` =
  1 - mean ``active_mask``).
* ``void_turn_ratio`` -- share of *trajectories* with at least one void turn (SimpleTIR
  ``env/void_turn_ratio`` = 1 - mean ``void_turn_mask``; SimpleTIR records void turns only
  when ``mask_void_turns`` is on, so its validation logs show 0 -- here they are always
  recorded). An engine-aborted or tool-failed turn is never void.
* ``num_code_use`` / ``code_use_ratio`` -- turns with a code block per trajectory, and
  the mean over trajectories of that count / ``turns`` (SimpleTIR ``env/num_code_use``,
  ``env/code_use_ratio``).
* ``num_valid_code`` / ``valid_code_ratio`` -- executions that succeeded with an empty
  stderr per trajectory, and the mean over trajectories of that count / ``turns``
  (SimpleTIR ``env/num_valid_code``, ``env/valid_code_ratio``: its "valid" is an empty
  stderr; a timeout or memory kill is invalid here whatever its sandbox wrote, and an
  infrastructure failure is not a valid execution).

This project's own quantities (different names, since they are different quantities):

* ``void_trajectory_ratio`` -- trajectories that *ended* on a void turn (status ``void``,
  excluded from the policy loss) / trajectories; equals ``void_turn_ratio`` with
  ``void_turn="stop"``.
* ``void_turn_share`` -- void turns / model turns.
* ``code_trajectory_ratio`` -- trajectories with at least one code turn / trajectories.
* ``exec_ok_ratio`` -- executions with status ``ok`` / executions (NaN without any).
* ``correct_with_code`` -- correct trajectories that executed code / correct trajectories
  (ZeroTIR's "code in correct answers"; NaN when nothing is correct).
* ``completed_ratio`` -- trajectories with status ``completed`` (a final answer) / trajectories.
* ``infra_failure_ratio`` -- trajectories ended by an engine abort or a sandbox failure
  (statuses ``aborted``, ``tool_failed``) / trajectories.
* ``mean_response_tokens`` / ``mean_model_tokens`` -- response length (model + feedback
  tokens) and its model part, per trajectory.

``EvalMetrics.diagnostics`` adds :func:`megatron_tir.observe.diagnostics.rollout_diagnostics`:
NeMo-RL's termination rates, ZeroTIR's curves under ZeroTIR's definitions and the reasoning
patterns of the correct trajectories (each defined in its module).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from megatron_tir.observe.diagnostics import rollout_diagnostics
from megatron_tir.rollout.batch import Group
from megatron_tir.rollout.trajectory import INFRA_STATUSES, FinishStatus, Trajectory
from megatron_tir.tir.markup import TurnKind
from sandbox_cluster.protocol import Status



def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem: n samples, c correct."""
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _ratio(num: float, den: float) -> float:
    return num / den if den else math.nan


def _mean(values: Sequence[float]) -> float:
    return _ratio(sum(values), len(values))


def finished_by_model(t: Trajectory) -> bool:
    """The model ended the trajectory: a final answer (text or tool) or a void turn."""
    if t.status in (FinishStatus.COMPLETED, FinishStatus.VOID):
        return True
    return t.status is FinishStatus.TRUNCATED and bool(t.turns) and t.turns[-1].kind is TurnKind.ANSWER


def _valid_execution(turn) -> bool:
    r = turn.tool.result
    return r.status is Status.OK and not r.stderr


def trajectory_metrics(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """The TIR behaviour metrics of the module docstring (no accuracy) for ``trajs``."""
    if not trajs:
        raise ValueError("no trajectories")
    turns = [len(t.turns) for t in trajs]
    code = [sum(x.kind is TurnKind.CODE for x in t.turns) for t in trajs]
    execs = [x for t in trajs for x in t.turns if x.tool is not None and not x.tool.infra_failure]
    valid = [sum(x.tool is not None and _valid_execution(x) for x in t.turns) for t in trajs]
    correct = [t for t in trajs if t.correct]
    all_turns = [x for t in trajs for x in t.turns]
    return {
        "num_turns": _mean(turns),
        "finish_ratio": _mean([finished_by_model(t) for t in trajs]),
        "void_turn_ratio": _mean([t.has_void_turn for t in trajs]),
        "num_code_use": _mean(code),
        "code_use_ratio": _mean([_ratio(c, n) if n else 0.0 for c, n in zip(code, turns)]),
        "num_valid_code": _mean(valid),
        "valid_code_ratio": _mean([_ratio(v, n) if n else 0.0 for v, n in zip(valid, turns)]),
        "void_trajectory_ratio": _mean([t.status is FinishStatus.VOID for t in trajs]),
        "void_turn_share": _ratio(sum(x.kind is TurnKind.VOID for x in all_turns), len(all_turns)),
        "code_trajectory_ratio": _mean([c > 0 for c in code]),
        "exec_ok_ratio": _ratio(sum(x.tool.status == Status.OK for x in execs), len(execs)),
        "correct_with_code": _ratio(sum(any(x.tool is not None for x in t.turns) for t in correct), len(correct)),
        "completed_ratio": _mean([t.status is FinishStatus.COMPLETED for t in trajs]),
        "infra_failure_ratio": _mean([t.status in INFRA_STATUSES for t in trajs]),
        "mean_response_tokens": _mean([len(t.response_ids) for t in trajs]),
        "mean_model_tokens": _mean([t.num_model_tokens for t in trajs]),
    }


@dataclass(kw_only=True, slots=True)
class EvalMetrics:
    k: int
    problems: int
    trajectories: int
    avg_at_k: float
    pass_at_k: float
    tir: dict[str, float]  # trajectory_metrics(): name -> value
    status_counts: dict[str, int] = field(default_factory=dict)
    # rollout_diagnostics(): NeMo-RL's termination rates, ZeroTIR's curves, the reasoning patterns, ...
    diagnostics: dict[str, float] = field(default_factory=dict)

    def lines(self) -> list[str]:
        """Human-readable lines; metric names as in the module docstring."""
        pct = lambda x: "n/a" if math.isnan(x) else f"{100 * x:.1f}%"  # noqa: E731
        m = self.tir
        return [
            f"problems: {self.problems}   trajectories: {self.trajectories}",
            f"avg@{self.k}: {pct(self.avg_at_k)}",
            f"pass@{self.k}: {pct(self.pass_at_k)}",
            f"void_turn_ratio: {pct(m['void_turn_ratio'])}   void_trajectory_ratio: "
            f"{pct(m['void_trajectory_ratio'])}   void_turn_share: {pct(m['void_turn_share'])}",
            f"finish_ratio: {pct(m['finish_ratio'])}   completed_ratio: {pct(m['completed_ratio'])}   "
            f"infra_failure_ratio: {pct(m['infra_failure_ratio'])}",
            f"code_use_ratio: {pct(m['code_use_ratio'])}   valid_code_ratio: {pct(m['valid_code_ratio'])}   "
            f"exec_ok_ratio: {pct(m['exec_ok_ratio'])}",
            f"code_trajectory_ratio: {pct(m['code_trajectory_ratio'])}   "
            f"correct_with_code: {pct(m['correct_with_code'])}",
            f"num_turns: {m['num_turns']:.2f}   num_code_use: {m['num_code_use']:.2f}   "
            f"num_valid_code: {m['num_valid_code']:.2f}",
            f"mean_response_tokens: {m['mean_response_tokens']:.1f} (model {m['mean_model_tokens']:.1f})",
            "status: " + ", ".join(f"{k}={v}" for k, v in sorted(self.status_counts.items())),
            *self.diagnostic_lines(pct),
        ]

    def diagnostic_lines(self, pct) -> list[str]:
        d = self.diagnostics
        if not d:
            return []
        return [
            "reasoning patterns of correct trajectories: " + "   ".join(
                f"{name}: {pct(d[f'pattern_{name}'])}" for name in ("error_correction", "progressive_reasoning",
                                                                   "cross_checking")),
            f"ZeroTIR: avg_repeat_score {d['avg_repeat_score']:.4f}   code_count {d['code_count']:.2f}   "
            f"code_proportion {pct(d['code_proportion'])}   code_in_correct {pct(d['code_in_correct'])}",
            f"natural_termination_rate: {pct(d['natural_termination_rate'])}   truncation_rate: "
            f"{pct(d['truncation_rate'])}   max_turns_reached_rate: {pct(d['max_turns_reached_rate'])}",
        ]


def compute_metrics(groups: Sequence[Group], k: int) -> EvalMetrics:
    """All metrics for ``groups`` (one per problem, each with >= k scored trajectories)."""
    if not groups:
        raise ValueError("no groups to evaluate")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    avg, passk = [], []
    trajs: list[Trajectory] = []
    for g in groups:
        rewards = g.rewards  # raises on unscored trajectories
        n = len(rewards)
        if n < k:
            raise ValueError(f"group {g.group_id} has {n} samples, fewer than k={k}")
        avg.append(sum(rewards[:k]) / k)
        passk.append(pass_at_k(n, sum(r > 0 for r in rewards), k))
        trajs.extend(g.trajectories)
    return EvalMetrics(
        k=k,
        problems=len(groups),
        trajectories=len(trajs),
        avg_at_k=sum(avg) / len(avg),
        pass_at_k=sum(passk) / len(passk),
        tir=trajectory_metrics(trajs),
        status_counts=dict(Counter(t.status.value if t.status else "none" for t in trajs)),
        diagnostics=rollout_diagnostics(trajs),
    )

"""Evaluation and TIR metrics, defined once (used by ``megatron-tir eval`` and training logs).

Accuracy (per problem with n sampled trajectories, c of them correct; averaged over problems):

* ``avg@k``  -- mean reward of the first k samples (k <= n); the paper's avg@k.
* ``pass@k`` -- the unbiased estimator 1 - C(n-c, k) / C(n, k) (Chen et al., 2021), the
  probability that at least one of k samples drawn without replacement from the n is
  correct.

TIR behaviour (over all trajectories, or over all turns / tool calls where stated):

* ``void_ratio``          -- trajectories that ended on a void turn / trajectories
  (SimpleTIR's filter rate: these are excluded from the policy loss).
* ``void_turn_ratio``     -- void turns / model turns.
* ``code_use_ratio``      -- trajectories with at least one executed code block / trajectories.
* ``valid_code_ratio``    -- code executions that exited cleanly (status ``ok``) / executions.
* ``mean_turns``          -- model turns per trajectory.
* ``mean_code_calls``     -- code executions per trajectory.
* ``correct_with_code``   -- correct trajectories that executed code / correct trajectories
  (ZeroTIR's "code in correct answers"; NaN when nothing is correct).
* ``finish_ratio``        -- trajectories with status ``completed`` (a final answer given
  as an answer turn or by ``final_answer()``) / trajectories.
* ``mean_response_tokens`` / ``mean_model_tokens`` -- response length (model + feedback
  tokens) and its model part, per trajectory.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from megatron_tir.rollout.batch import Group
from megatron_tir.rollout.trajectory import FinishStatus, Trajectory
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


@dataclass(kw_only=True, slots=True)
class EvalMetrics:
    k: int
    problems: int
    trajectories: int
    avg_at_k: float
    pass_at_k: float
    void_ratio: float
    void_turn_ratio: float
    code_use_ratio: float
    valid_code_ratio: float
    mean_turns: float
    mean_code_calls: float
    correct_with_code: float
    finish_ratio: float
    mean_response_tokens: float
    mean_model_tokens: float
    status_counts: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}

    def lines(self) -> list[str]:
        """Human-readable lines, one metric each."""
        pct = lambda x: "n/a" if math.isnan(x) else f"{100 * x:.1f}%"  # noqa: E731
        return [
            f"problems: {self.problems}   trajectories: {self.trajectories}",
            f"avg@{self.k}: {pct(self.avg_at_k)}",
            f"pass@{self.k}: {pct(self.pass_at_k)}",
            f"void-trajectory ratio: {pct(self.void_ratio)}   void-turn ratio: {pct(self.void_turn_ratio)}",
            f"code-use ratio: {pct(self.code_use_ratio)}   valid-code ratio: {pct(self.valid_code_ratio)}",
            f"correct answers that used code: {pct(self.correct_with_code)}",
            f"finish ratio: {pct(self.finish_ratio)}",
            f"mean turns: {self.mean_turns:.2f}   mean code calls: {self.mean_code_calls:.2f}",
            f"mean response tokens: {self.mean_response_tokens:.1f} (model {self.mean_model_tokens:.1f})",
            "status: " + ", ".join(f"{k}={v}" for k, v in sorted(self.status_counts.items())),
        ]


def _ratio(num: float, den: float) -> float:
    return num / den if den else math.nan


def _executions(t: Trajectory) -> list:
    return [turn.tool for turn in t.turns if turn.tool is not None]


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
        correct = [r > 0 for r in rewards]
        avg.append(sum(rewards[:k]) / k)
        passk.append(pass_at_k(n, sum(correct), k))
        trajs.extend(g.trajectories)
    T = len(trajs)
    turns = [turn for t in trajs for turn in t.turns]
    execs = [e for t in trajs for e in _executions(t)]
    correct_trajs = [t for t in trajs if t.correct]
    return EvalMetrics(
        k=k,
        problems=len(groups),
        trajectories=T,
        avg_at_k=sum(avg) / len(avg),
        pass_at_k=sum(passk) / len(passk),
        void_ratio=_ratio(sum(t.status is FinishStatus.VOID for t in trajs), T),
        void_turn_ratio=_ratio(sum(turn.kind is TurnKind.VOID for turn in turns), len(turns)),
        code_use_ratio=_ratio(sum(bool(_executions(t)) for t in trajs), T),
        valid_code_ratio=_ratio(sum(e.status is Status.OK for e in execs), len(execs)),
        mean_turns=_ratio(len(turns), T),
        mean_code_calls=_ratio(len(execs), T),
        correct_with_code=_ratio(sum(bool(_executions(t)) for t in correct_trajs), len(correct_trajs)),
        finish_ratio=_ratio(sum(t.status is FinishStatus.COMPLETED for t in trajs), T),
        mean_response_tokens=_ratio(sum(len(t.response_ids) for t in trajs), T),
        mean_model_tokens=_ratio(sum(t.num_model_tokens for t in trajs), T),
        status_counts=dict(Counter(t.status.value if t.status else "none" for t in trajs)),
    )

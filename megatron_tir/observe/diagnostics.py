"""Rollout diagnostics, named as the papers and anchor frameworks name them (rank 0, from the records).

Per turn index ``K`` (SimpleTIR, arXiv 2509.02479, Figure 3: token probabilities fall in
later turns when tool feedback drifts the model off its distribution), over the model
tokens of turn K of every trajectory, from the engine's (behaviour) log-probs:

* ``logprob_turn_K`` -- mean token log-prob (already in :mod:`megatron_tir.train.metrics`);
* ``logprob_min_turn_K`` -- minimum token log-prob;
* ``low_prob_share_turn_K`` -- share of tokens with ``p < 1e-3`` (SimpleTIR's "low-probability
  tokens", Figure 3b).

Response length (model + feedback tokens per trajectory): ``response_tokens_min`` /
``_p50`` / ``_p90`` / ``_max`` (nearest-rank percentiles) and ``budget_hit_share``, the share
of trajectories whose generation was cut by the token budget (a turn's engine request ended
with finish reason ``length``).

``void_reason/<slug>`` -- the number of trajectories that ended on a void turn, by reason
(the reason text of :func:`megatron_tir.tir.classify_turn`, cut before its parenthesis).

NeMo-RL's rates (``nemo_rl/experience/rollouts.py``, ``run_sample_multi_turn_rollout`` /
``run_async_multi_turn_rollout``: ``natural_termination_rate``, ``truncation_rate``,
``max_turns_reached_rate``, one flag per sample, disjoint there as here):

* ``natural_termination_rate`` -- the episode ended by the protocol itself: a final answer or
  a void turn (statuses ``completed``, ``void``; NeMo-RL: the environment said terminated);
* ``truncation_rate`` -- the response-token budget ran out (status ``truncated``);
* ``max_turns_reached_rate`` -- the turn budget ran out (status ``max_turns``).

ZeroTIR's curves and the reasoning patterns live in :mod:`megatron_tir.observe.zerotir` and
:mod:`megatron_tir.observe.patterns`; the learner-side signals (entropy and importance ratio
per turn, ``ppo_kl``) in :mod:`megatron_tir.observe.probe`; the grad-norm spike flag in
:class:`GradNormSpikes`.
"""

from __future__ import annotations

import math
import re
from collections import Counter, deque
from collections.abc import Sequence

from megatron_tir.rollout.engines.base import FinishReason
from megatron_tir.rollout.trajectory import FinishStatus, Trajectory

LOW_PROB = 1e-3
LOW_LOGPROB = math.log(LOW_PROB)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in [0, 100]) of a non-empty sequence."""
    if not values:
        raise ValueError("percentile of nothing")
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return float(ordered[rank - 1])


def void_reason_slug(reason: str | None) -> str:
    """``"length cut inside a code block (partial code)"`` -> ``"length_cut_inside_a_code_block"``."""
    head = (reason or "unknown").split(" (")[0].lower()
    return re.sub(r"[^a-z0-9]+", "_", head).strip("_")[:60] or "unknown"


def turn_token_stats(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """Minimum log-prob and share of ``p < 1e-3`` tokens of the model tokens of each turn index."""
    by_turn: dict[int, list[float]] = {}
    for t in trajs:
        for turn in t.turns:
            lp = [x for x in t.response_logprobs[turn.start:turn.start + turn.model_tokens] if not math.isnan(x)]
            if lp:
                by_turn.setdefault(turn.index, []).extend(lp)
    out = {}
    for k, lps in sorted(by_turn.items()):
        out[f"logprob_min_turn_{k}"] = min(lps)
        out[f"low_prob_share_turn_{k}"] = sum(x < LOW_LOGPROB for x in lps) / len(lps)
    return out


def budget_hit(t: Trajectory) -> bool:
    """The token budget cut the trajectory's generation (a turn ended by ``length``)."""
    return t.status is FinishStatus.TRUNCATED or any(x.finish_reason is FinishReason.LENGTH for x in t.turns)


def length_stats(trajs: Sequence[Trajectory]) -> dict[str, float]:
    lengths = [len(t.response_ids) for t in trajs]
    return {
        "response_tokens_min": float(min(lengths)),
        "response_tokens_p50": percentile(lengths, 50),
        "response_tokens_p90": percentile(lengths, 90),
        "response_tokens_max": float(max(lengths)),
        "budget_hit_share": sum(budget_hit(t) for t in trajs) / len(trajs),
    }


def termination_rates(trajs: Sequence[Trajectory]) -> dict[str, float]:
    n = len(trajs)
    natural = (FinishStatus.COMPLETED, FinishStatus.VOID)
    return {
        "natural_termination_rate": sum(t.status in natural for t in trajs) / n,
        "truncation_rate": sum(t.status is FinishStatus.TRUNCATED for t in trajs) / n,
        "max_turns_reached_rate": sum(t.status is FinishStatus.MAX_TURNS for t in trajs) / n,
    }


def void_reasons(trajs: Sequence[Trajectory]) -> dict[str, float]:
    counts = Counter(void_reason_slug(t.void_reason) for t in trajs if t.status is FinishStatus.VOID)
    return {f"void_reason/{k}": float(v) for k, v in sorted(counts.items())}


def rollout_diagnostics(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """Every diagnostic of this module, ZeroTIR's and the reasoning patterns for ``trajs`` (unprefixed)."""
    from megatron_tir.observe.patterns import pattern_rates
    from megatron_tir.observe.zerotir import zerotir_metrics

    if not trajs:
        return {}
    return (turn_token_stats(trajs) | length_stats(trajs) | termination_rates(trajs) | void_reasons(trajs)
            | zerotir_metrics(trajs) | pattern_rates(trajs))


class GradNormSpikes:
    """Flags a grad norm (before clipping) above ``factor`` times the mean of the previous
    ``window`` finite values (SimpleTIR Figure 5: gradient-norm spikes precede a collapse).
    No flag until ``min_history`` values have been seen."""

    def __init__(self, *, window: int = 20, factor: float = 3.0, min_history: int = 3) -> None:
        if window < 1 or factor <= 1 or min_history < 1:
            raise ValueError("need window >= 1, factor > 1, min_history >= 1")
        self.factor, self.min_history = factor, min_history
        self._history: deque[float] = deque(maxlen=window)

    @property
    def history(self) -> list[float]:
        """The window's values, oldest first (what a run checkpoint keeps: a resume continues the statistics)."""
        return list(self._history)

    def restore(self, values) -> None:
        """Continue from a saved ``history`` (the window's newest values are kept)."""
        self._history.clear()
        self._history.extend(float(v) for v in values if math.isfinite(float(v)))

    def update(self, grad_norm: float) -> dict[str, float]:
        """``{"train/grad_norm_ma": mean of the previous window, "train/grad_norm_spike": 0/1}``
        (empty without history); then ``grad_norm`` joins the window when finite."""
        out = {}
        if len(self._history) >= self.min_history:
            ma = sum(self._history) / len(self._history)
            out = {"train/grad_norm_ma": ma, "train/grad_norm_spike": float(grad_norm > self.factor * ma)}
        if math.isfinite(grad_norm):
            self._history.append(grad_norm)
        return out

"""Training metrics: what a step's rollouts did, one JSON line per step (:mod:`megatron_tir.observe.metrics_file`), TensorBoard.

Rollout behaviour is :func:`megatron_tir.eval.metrics.trajectory_metrics` (SimpleTIR's
``num_turns``, ``finish_ratio``, ``void_turn_ratio``, ``code_use_ratio``, ``valid_code_ratio``,
and this project's ``void_trajectory_ratio``, ``code_trajectory_ratio``, ``correct_with_code``,
... -- defined there); the trainer adds
reward/accuracy over every sampled trajectory, feedback tokens, and the mean engine log-prob
of the model tokens of each turn index (``logprob_turn_K``, SimpleTIR's Figure 3 signal:
it falls in later turns when feedback drifts the model off its distribution), and the
diagnostics of :func:`megatron_tir.observe.diagnostics.rollout_diagnostics` (per-turn minimum
log-prob and low-probability share, response-length percentiles, budget hits, void reasons,
NeMo-RL's termination rates, ZeroTIR's code-use curves, reasoning patterns); over a mix of
sources (``data_source``), the reward of each (``reward_by_source/<source>``).
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from megatron_tir.eval.metrics import trajectory_metrics
from megatron_tir.observe.diagnostics import rollout_diagnostics
from megatron_tir.observe.metrics_file import METRICS_FILE
from megatron_tir.rollout.batch import Group


def rollout_metrics(groups: Sequence[Group], prefix: str = "rollout") -> dict[str, float]:
    trajs = [t for g in groups for t in g.trajectories]
    if not trajs:
        return {}
    out = {
        "reward": sum(t.reward or 0.0 for t in trajs) / len(trajs),
        "accuracy": sum(t.correct for t in trajs) / len(trajs),
        **trajectory_metrics(trajs),
        "trajectories": float(len(trajs)),
        # per trajectory (they overlap in time: many trajectories are in flight at once)
        "generation_s": sum(t.timings.generation_s for t in trajs) / len(trajs),
        "tool_s": sum(t.timings.tool_s for t in trajs) / len(trajs),
        "reward_s": sum(t.timings.reward_s for t in trajs) / len(trajs),
    }
    out["mean_feedback_tokens"] = out["mean_response_tokens"] - out["mean_model_tokens"]
    for status, n in Counter(t.status.value if t.status else "none" for t in trajs).items():
        out[f"status_{status}"] = float(n)
    by_turn: dict[int, list[float]] = {}
    for t in trajs:
        for turn in t.turns:
            lp = t.response_logprobs[turn.start:turn.start + turn.model_tokens]
            if lp:
                by_turn.setdefault(turn.index, []).extend(lp)
    for k, lps in sorted(by_turn.items()):
        out[f"logprob_turn_{k}"] = sum(lps) / len(lps)
    out |= rollout_diagnostics(trajs)
    sources = sorted({t.data_source for t in trajs})
    if len(sources) > 1:  # a mix (tir_mix: one per family, the held-out family's own curve among them)
        for source in sources:
            mine = [t.reward or 0.0 for t in trajs if t.data_source == source]
            out[f"reward_by_source/{source or 'none'}"] = sum(mine) / len(mine)
    return {f"{prefix}/{k}": v for k, v in out.items()}


def interruption_metrics(groups: Sequence[Group], prefix: str = "rollout") -> dict[str, float]:
    """Partial rollouts (``trainer.async=full``): a trajectory is *interrupted* when a weight sync
    landed inside one of its model turns (the turn's tokens carry more than one weight version);
    ``interrupted_share`` is their share, ``interrupted_spans_mean`` the mean number of version
    spans (runs of one version) over an interrupted trajectory's model tokens, and
    ``multi_version_share`` the share whose model tokens have more than one version at all (a sync
    between two turns counts there, not as an interruption)."""
    trajs = [t for g in groups for t in g.trajectories]
    if not trajs:
        return {}
    interrupted, spans, multi = 0, 0, 0
    for t in trajs:
        model = [v for v in t.response_versions if v >= 0]
        multi += len(set(model)) > 1
        if any(len(set(t.response_versions[turn.start:turn.start + turn.model_tokens])) > 1 for turn in t.turns):
            interrupted += 1
            spans += 1 + sum(a != b for a, b in zip(model, model[1:]))
    return {f"{prefix}/interrupted_share": interrupted / len(trajs),
            f"{prefix}/interrupted_spans_mean": spans / interrupted if interrupted else 0.0,
            f"{prefix}/multi_version_share": multi / len(trajs)}


class MetricsSink:
    """Appends one JSON line per step to ``RUN_DIR/metrics.jsonl`` and hands the same metrics to
    the trackers (:mod:`megatron_tir.observe.trackers`; default: TensorBoard in ``RUN_DIR/tb``). Rank 0 only."""

    def __init__(self, run_dir: str | os.PathLike, *, truncate_to: int | None = None, trackers=None) -> None:
        self.path = Path(run_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if truncate_to is not None and self.path.exists():  # a resume drops lines of steps run after the checkpoint
            with open(self.path, "r+b") as f:
                f.truncate(truncate_to)
        if trackers is None:
            from megatron_tir.observe.trackers import TensorBoardTracker

            trackers = [TensorBoardTracker(Path(run_dir), None)]
        self._trackers = list(trackers)
        self._file = open(self.path, "a")

    @property
    def offset(self) -> int:
        self._file.flush()
        return self._file.tell()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
        self._file.write(json.dumps({"step": step, **clean}) + "\n")
        self._file.flush()
        for t in self._trackers:
            t.log_metrics(step, metrics)

    def log_samples(self, step: int, name: str, rows) -> None:
        """A few rendered trajectories for the trackers' text / table views."""
        for t in self._trackers:
            t.log_samples(step, name, rows)

    def close(self) -> None:
        self._file.close()
        for t in self._trackers:
            t.close()


class NoMetrics:
    """The sink of the ranks that write no metrics (all but rank 0): it keeps nothing."""

    offset = 0

    def log(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def close(self) -> None:
        pass


def open_metrics(run_dir: str | os.PathLike, *, truncate_to: int | None = None, trackers=None) -> MetricsSink | NoMetrics:
    """Rank 0's :class:`MetricsSink` (``trackers()``: its trackers); :class:`NoMetrics` on the other ranks."""
    import torch

    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return NoMetrics()
    return MetricsSink(run_dir, truncate_to=truncate_to, trackers=None if trackers is None else trackers())

"""Metrics of the trained rows that add up over ranks: each rank holds its replica's share only.

A rank that computes a loss (the last pipeline stage) knows its data-parallel replica's rows;
rank 0, which logs, knows its own. ``RowStats`` keeps a metric as what sums over replicas --
a mean as ``(sum, count)``, a total, a maximum -- and :func:`reduce_over_replicas` adds them
up over the world, one rank per replica counting (the last stage's tensor-parallel rank 0), so
every rank gets the metrics of the whole batch: means weighted by token counts, maxima of the
maxima, totals (and histogram bins) summed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass(kw_only=True, slots=True)
class RowStats:
    means: dict[str, tuple[float, float]] = field(default_factory=dict)  # name -> (sum, count)
    totals: dict[str, float] = field(default_factory=dict)
    maxima: dict[str, float] = field(default_factory=dict)

    def add_mean(self, name: str, values: torch.Tensor) -> None:
        """``values`` (the entries the mean runs over) into the mean ``name``."""
        self.means[name] = (float(values.double().sum()), float(values.numel()))

    def merge(self, other: RowStats) -> RowStats:
        out = RowStats(means=dict(self.means), totals=dict(self.totals), maxima=dict(self.maxima))
        for k, (s, n) in other.means.items():
            s0, n0 = out.means.get(k, (0.0, 0.0))
            out.means[k] = (s0 + s, n0 + n)
        for k, v in other.totals.items():
            out.totals[k] = out.totals.get(k, 0.0) + v
        for k, v in other.maxima.items():
            out.maxima[k] = max(out.maxima.get(k, -math.inf), v)
        return out

    def mean(self, name: str, empty: float = 0.0) -> float:
        s, n = self.means.get(name, (0.0, 0.0))
        return s / n if n else empty

    def count(self, name: str) -> float:
        return self.means.get(name, (0.0, 0.0))[1]


def reduce_over_replicas(mine: RowStats | None) -> RowStats:
    """The sum of every replica's ``RowStats``, on every rank (collective over the world). ``mine``:
    this rank's, or None where the rank does not count (not the last stage's TP rank 0)."""
    from megatron.core import parallel_state

    counts = parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0
    gathered: list[tuple | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, (mine.means, mine.totals, mine.maxima) if counts and mine else None)
    out = RowStats()
    for part in gathered:
        if part is not None:
            out = out.merge(RowStats(means=part[0], totals=part[1], maxima=part[2]))
    return out

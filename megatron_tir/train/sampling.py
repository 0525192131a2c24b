"""Dynamic sampling (rank 0): rounds of rollouts until the train batch holds enough groups that pass the
group filter (:func:`collect_groups`, :func:`filter_groups`), and what was collected (:class:`Collected`),
with each sampled row's fate for the observers (:meth:`Collected.fates`)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from megatron_tir.observe.dumps import RowFate
from megatron_tir.rl import ADVANTAGE_ESTIMATORS, group_keep_G, row_weights
from megatron_tir.rollout.batch import Group
from megatron_tir.train.batch import plan_update, row_summaries, to_tensors

SAMPLING_STRATEGIES = ("rounds", "oversample")


def filter_groups(groups: Sequence[Group], *, drop_zero_std: bool, accuracy_lo: float, accuracy_hi: float,
                  overlong: str = "keep", min_rows: int = 1) -> tuple[list[Group], dict[str, int]]:
    """The groups the update keeps (dynamic sampling) and how many each rule removed; with
    ``overlong="drop"`` truncated rows do not count (``min_rows``: counted rows a group needs)."""
    if not groups:
        return [], {"no_counted_rows": 0, "zero_std": 0, "accuracy": 0}
    s = row_summaries(groups)
    stats_B, _ = row_weights(void_B=s.void_B, infra_B=s.infra_B, truncated_B=s.truncated_B, drop_void=False,
                             overlong="drop" if overlong == "drop" else "keep")
    keep_G, removed = group_keep_G(s.rewards_B, s.group_index_B, stats_B, drop_zero_std=drop_zero_std,
                                   accuracy_lo=accuracy_lo, accuracy_hi=accuracy_hi, min_rows=min_rows)
    return [g for g, k in zip(groups, keep_G.tolist()) if k], removed


@dataclass(kw_only=True, slots=True)
class Collected:
    groups: list[Group]  # at most ``want``, the train batch
    sampled: list[Group]  # everything sampled (for the rollout metrics)
    rounds: int
    removed: dict[str, int]  # groups removed by each filter rule
    stale: list[Group] = field(default_factory=list)  # trainer.async=full: dropped for staleness (also in sampled)

    def fates(self, *, mode: str, advantage: str, overlong: str, drop_zero_std: bool, accuracy_lo: float,
              accuracy_hi: float, min_rows: int = 1) -> dict[tuple[int, int], RowFate]:
        """``(group_id, sample_index) ->`` what the update did with each sampled row, by the rules that
        decided it (the run's settings): the group filter of :func:`collect_groups` on the groups not
        kept (``surplus``: passed, but the batch was full; ``stale``), :func:`plan_update` on the kept
        ones (an estimator outside ``ADVANTAGE_ESTIMATORS``, a critic's GAE, records no advantage)."""
        out, kept, stale = {}, {id(g) for g in self.groups}, {id(g) for g in self.stale}
        for g in (g for g in self.sampled if id(g) not in kept):
            _, removed = filter_groups([g], drop_zero_std=drop_zero_std, accuracy_lo=accuracy_lo,
                                       accuracy_hi=accuracy_hi, overlong=overlong, min_rows=min_rows)
            rule = "stale" if id(g) in stale else next((k for k, v in removed.items() if v), "surplus")
            out |= {(t.group_id, t.sample_index): RowFate(in_stats=False, in_loss=False, advantage=None,
                                                          group_rule=rule) for t in g.trajectories}
        if self.groups:
            estimated = advantage in ADVANTAGE_ESTIMATORS
            plan = plan_update(to_tensors(self.groups, pad_id=0), mode=mode, advantage=advantage if estimated else None,
                               overlong=overlong, mini_batches=1)
            for b, t in enumerate(t for g in self.groups for t in g.trajectories):
                out[(t.group_id, t.sample_index)] = RowFate(
                    in_stats=bool(plan.stats_B[b]), in_loss=bool(plan.trained_B[b]),
                    advantage=float(plan.advantages_B[b]) if estimated else None)
        return out


async def collect_groups(run_round, *, want: int, max_rounds: int, drop_zero_std: bool, accuracy_lo: float,
                         accuracy_hi: float, overlong: str = "keep", min_rows: int = 1, strategy: str = "rounds",
                         seed: int = 0) -> Collected:
    """Dynamic sampling: call ``run_round()`` (an async function returning scored groups) until
    ``want`` groups pass the group filter or ``max_rounds`` rounds are spent. Fewer (even none)
    kept groups is a valid outcome: the caller trains on what there is or skips the update.

    ``strategy="oversample"`` (SimpleTIR's release, ``trainer.oversample_multiplier``): one round;
    ``want`` of the groups that pass are picked at random (``seed``), and a short batch is filled
    by repeating passing groups (each repeat is its own group in the statistics, as there)."""
    kept: list[Group] = []
    sampled: list[Group] = []
    removed = {"no_counted_rows": 0, "zero_std": 0, "accuracy": 0}
    rounds = 0
    if strategy not in SAMPLING_STRATEGIES:
        raise ValueError(f"sampling strategy must be one of {', '.join(SAMPLING_STRATEGIES)}, got {strategy!r}")
    if strategy == "oversample":
        max_rounds = 1
    while len(kept) < want and rounds < max_rounds:
        groups = await run_round()
        rounds += 1
        sampled.extend(groups)
        ok, rem = filter_groups(groups, drop_zero_std=drop_zero_std, accuracy_lo=accuracy_lo,
                                accuracy_hi=accuracy_hi, overlong=overlong, min_rows=min_rows)
        for k, v in rem.items():
            removed[k] += v
        kept.extend(ok)
    if strategy == "oversample" and kept:
        rng = random.Random(seed)
        kept = rng.sample(kept, want) if len(kept) >= want else kept + [rng.choice(kept) for _ in range(want - len(kept))]
    return Collected(groups=kept[:want], sampled=sampled, rounds=rounds, removed=removed)

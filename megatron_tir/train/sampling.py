"""Dynamic sampling (rank 0): rounds of rollouts until the train batch holds enough groups that pass the
group filter (:func:`collect_groups`, :func:`filter_groups`), and what was collected (:class:`Collected`),
with the rule that kept each sampled group out of the batch (``Collected.rules``: what the observers
are told, with the update plan's row roles, as each row's fate)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from megatron_tir.rl import group_keep_G, row_weights
from megatron_tir.rollout.batch import Group, row_summaries

SAMPLING_STRATEGIES = ("rounds", "oversample")


def filter_groups(groups: Sequence[Group], *, drop_zero_std: bool, accuracy_lo: float, accuracy_hi: float,
                  overlong: str = "keep", min_rows: int = 1) -> tuple[list[Group], dict[str, int]]:
    """The groups the update keeps (dynamic sampling) and how many each rule removed; with
    ``overlong="drop"`` truncated rows do not count (``min_rows``: counted rows a group needs)."""
    rules = group_rules(groups, drop_zero_std=drop_zero_std, accuracy_lo=accuracy_lo, accuracy_hi=accuracy_hi,
                        overlong=overlong, min_rows=min_rows)
    removed = {"no_counted_rows": 0, "zero_std": 0, "accuracy": 0}
    for rule in filter(None, rules):
        removed[rule] += 1
    return [g for g, rule in zip(groups, rules) if rule is None], removed


def group_rules(groups: Sequence[Group], *, drop_zero_std: bool, accuracy_lo: float, accuracy_hi: float,
                overlong: str = "keep", min_rows: int = 1) -> list[str | None]:
    """Per group, the group filter's rule that removes it (a key of :func:`megatron_tir.rl.group_keep_G`'s
    counts), None for a group it keeps (:func:`filter_groups`)."""
    if not groups:
        return []
    s = row_summaries(groups)
    stats_B, _ = row_weights(void_B=s.void_B, infra_B=s.infra_B, truncated_B=s.truncated_B, drop_void=False,
                             overlong="drop" if overlong == "drop" else "keep", data_error_B=s.data_error_B)
    rules = []
    for g in range(len(groups)):  # one group at a time: which rule removed it
        rows = s.group_index_B == g
        _, removed = group_keep_G(s.rewards_B[rows], s.group_index_B[rows] - g, stats_B[rows],
                                  drop_zero_std=drop_zero_std, accuracy_lo=accuracy_lo, accuracy_hi=accuracy_hi,
                                  min_rows=min_rows)
        rules.append(next((k for k, v in removed.items() if v), None))
    return rules


@dataclass(kw_only=True, slots=True)
class Collected:
    groups: list[Group]  # at most ``want``, the train batch
    sampled: list[Group]  # everything sampled (for the rollout metrics)
    rounds: int
    removed: dict[str, int]  # groups removed by each filter rule
    # group id -> why a sampled group is not in the batch: a group-filter rule, "surplus" (passed, but the
    # batch was full) or "stale" (trainer.async=full: too many versions behind)
    rules: dict[int, str] = field(default_factory=dict)


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
    rules: dict[int, str] = {}
    while len(kept) < want and rounds < max_rounds:
        groups = await run_round()
        rounds += 1
        sampled.extend(groups)
        for g, rule in zip(groups, group_rules(groups, drop_zero_std=drop_zero_std, accuracy_lo=accuracy_lo,
                                               accuracy_hi=accuracy_hi, overlong=overlong, min_rows=min_rows)):
            if rule is None:
                kept.append(g)
            else:
                removed[rule] += 1
                rules[g.group_id] = rule
    if strategy == "oversample" and kept:
        rng = random.Random(seed)
        kept = rng.sample(kept, want) if len(kept) >= want else kept + [rng.choice(kept) for _ in range(want - len(kept))]
    batch = kept[:want]
    chosen = {id(g) for g in batch}
    rules |= {g.group_id: "surplus" for g in kept if id(g) not in chosen}
    return Collected(groups=batch, sampled=sampled, rounds=rounds, removed=removed, rules=rules)

"""SimpleTIR's released sampling and filters: ``remove_clip`` (truncated rows leave the statistics
and the loss, groups with fewer than 4 rows left are dropped) and over-sampling once with a random
pick and a short batch filled by repeats."""

from __future__ import annotations

import asyncio

import pytest
import torch

from megatron_tir.rl import group_keep_G, row_weights
from megatron_tir.train.sampling import collect_groups


def test_overlong_drop_removes_truncated_rows_from_the_statistics():
    void, infra = torch.tensor([False, False, False]), torch.tensor([False, False, True])
    trunc = torch.tensor([True, False, False])
    assert [x.tolist() for x in row_weights(void_B=void, infra_B=infra, truncated_B=trunc, drop_void=True,
                                            overlong="drop")] == [[False, True, False], [False, True, False]]
    assert row_weights(void_B=void, infra_B=infra, truncated_B=trunc, drop_void=True,
                       overlong="mask")[0].tolist() == [True, True, False]  # mask: still in the statistics


def test_groups_with_too_few_counted_rows_are_dropped():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    group = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    stats = torch.tensor([True, True, True, True, True, True, False, False])  # group 1: 2 rows left
    keep, removed = group_keep_G(rewards, group, stats, drop_zero_std=True, min_rows=4)
    assert keep.tolist() == [True, False] and removed["no_counted_rows"] == 1
    keep, _ = group_keep_G(rewards, group, stats, drop_zero_std=True)
    assert keep.tolist() == [True, True]


class _G:  # a scored group as the filter sees it, via group_rules' stand-in below
    def __init__(self, gid, ok):
        self.group_id, self.ok = gid, ok


@pytest.fixture
def fake_filter(monkeypatch):
    import megatron_tir.train.sampling as batch

    def group_rules(groups, **kw):  # the rule that removes each group (None: kept)
        return [None if g.ok else "zero_std" for g in groups]

    monkeypatch.setattr(batch, "group_rules", group_rules)


def _rounds(batches):
    it = iter(batches)

    async def one_round():
        return next(it)
    return one_round


def test_oversample_picks_at_random_and_fills_a_short_batch_by_repeats(fake_filter):
    many = [_G(i, i % 3 != 0) for i in range(12)]  # 8 pass
    got = asyncio.run(collect_groups(_rounds([many, many]), want=4, max_rounds=3, drop_zero_std=True,
                                     accuracy_lo=0, accuracy_hi=1, strategy="oversample", seed=1))
    assert got.rounds == 1 and len(got.groups) == 4 and len({g.group_id for g in got.groups}) == 4
    assert all(g.ok for g in got.groups)
    assert [g.group_id for g in got.groups] != [1, 2, 4, 5]  # not simply the first that passed
    few = [_G(i, i < 2) for i in range(6)]  # 2 pass
    got = asyncio.run(collect_groups(_rounds([few]), want=5, max_rounds=3, drop_zero_std=True,
                                     accuracy_lo=0, accuracy_hi=1, strategy="oversample", seed=0))
    assert got.rounds == 1 and len(got.groups) == 5 and {g.group_id for g in got.groups} == {0, 1}
    rounds = asyncio.run(collect_groups(_rounds([few, few, few]), want=5, max_rounds=3, drop_zero_std=True,
                                        accuracy_lo=0, accuracy_hi=1))  # the default: up to 3 rounds, no repeats
    assert rounds.rounds == 3 and len(rounds.groups) == 5

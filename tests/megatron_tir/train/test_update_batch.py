"""The update batch of each Table-2 mode on crafted groups; dynamic sampling refills or comes back empty."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from crafted_rollouts import A, C, F, T, V, group

from megatron_tir.rollout.batch import Group, collate
from megatron_tir.rollout.trajectory import FinishStatus, Trajectory
from megatron_tir.train.batch import build_update, deal_rows, mini_batches, plan_update
from megatron_tir.train.sampling import collect_groups, filter_groups

S3 = math.sqrt(1 / 3)


def crafted():
    # group 0: correct, void, wrong, tool-failed(reward 1, must not count); group 1: correct, truncated, 2 wrong
    return [group(0, (C, 1.0), (V, 0.0), (C, 0.0), (F, 1.0)), group(1, (C, 1.0), (T, 0.0), (C, 0.0), (A, 0.0))]


def update(mode, overlong="mask", fraction=0.0, advantage="grpo", mini=1):
    """(the plan of every row, the update of the rows it trains)"""
    plan = plan_update(collate(crafted(), pad_id=0), mode=mode, advantage=advantage, overlong=overlong,
                       mini_batches=mini)
    return plan, build_update(plan.rows, plan.rows.engine_logprobs_BT, mode=mode, low_prob_fraction=fraction)


def test_simpletir_void_in_stats_not_in_loss_infra_in_neither():
    p, u = update("simpletir")
    # group 0 stats {1, 0, 0} (tool-failed out): A = (2/3)/sqrt(1/3), (-1/3)/sqrt(1/3); group 1 {1, 0, 0}
    # (aborted out, truncated in): the same numbers
    a, b = (2 / 3) / S3, (-1 / 3) / S3
    torch.testing.assert_close(p.advantages_B, torch.tensor([a, b, b, 0, a, b, b, 0]), atol=1e-4, rtol=0)
    assert p.stats_B.tolist() == [True, True, True, False, True, True, True, False]
    assert p.trained_B.tolist() == [True, False, True, False, True, False, True, False]
    assert u.batch.tokens_BT.shape[0] == 4  # rows without loss tokens are not sent to the learner
    # loss tokens: the 3 sampled response tokens (columns 2..4), never the prompt
    assert u.batch.loss_mask_BT.tolist() == [[0, 0, 1, 1, 1]] * 4
    torch.testing.assert_close(u.batch.extras["advantages_BT"][:, 2], torch.tensor([a, b, a, b]), atol=1e-4, rtol=0)
    torch.testing.assert_close(u.batch.extras["old_logprobs_BT"][0], torch.tensor([0, 0, -0.5, -1.0, -2.0]))


@pytest.mark.parametrize("mode", ["naive", "stop_without_filter", "high_ratio_filter"])
def test_modes_without_void_filter_train_on_void_rows(mode):
    p, u = update(mode)
    assert p.trained_B.tolist() == [True, True, True, False, True, False, True, False]
    assert u.batch.tokens_BT.shape[0] == 5


def test_overlong_keep_trains_on_truncated_rows():
    p, _ = update("simpletir", overlong="keep")
    assert p.trained_B.tolist() == [True, False, True, False, True, True, True, False]


def test_low_prob_filter_masks_each_rows_lowest_tokens():
    _, u = update("low_prob_filter", fraction=0.34)  # ceil(0.34 * 3) = 2 of each row's 3 tokens
    assert u.batch.loss_mask_BT.tolist() == [[0, 0, 1, 0, 0]] * 5
    assert u.low_prob_masked == 10


def test_reinforce_pp_uses_batch_statistics():
    u, _ = update("simpletir", advantage="reinforce_pp")
    # counted rows: rewards {1, 0, 0, 1, 0, 0} x 3 tokens each: mean 1/3, std over 18 tokens sqrt((6*4/9 + 12/9)/17)
    std = math.sqrt((6 * 4 / 9 + 12 * 1 / 9) / 17)
    assert u.advantages_B[0].item() == pytest.approx((2 / 3) / std, abs=1e-4)
    assert u.advantages_B[3].item() == 0.0


def test_mini_batches_split_whole_groups():
    _, u = update("stop_without_filter", mini=2)
    parts = mini_batches(u, 2)
    assert [p.tokens_BT.shape[0] for p in parts] == [3, 2]
    assert sum(p.loss_mask_BT.sum().item() for p in parts) == u.batch.loss_mask_BT.sum().item()


def _rounds(*rounds):
    it = iter(rounds)

    async def run_round():
        return next(it)
    return run_round


def test_dynamic_sampling_refills_to_the_train_batch():
    flat = group(0, (C, 1.0), (C, 1.0))  # zero std: dropped
    good = [group(1, (C, 1.0), (C, 0.0)), group(2, (C, 0.0), (C, 1.0))]
    got = asyncio.run(collect_groups(_rounds([flat, good[0]], [good[1], group(3, (C, 0.0), (C, 1.0))]), want=2,
                                     max_rounds=3, drop_zero_std=True, accuracy_lo=0.0, accuracy_hi=1.0))
    assert [g.group_id for g in got.groups] == [1, 2] and got.rounds == 2
    assert got.removed["zero_std"] == 1 and len(got.sampled) == 4


def test_dynamic_sampling_that_empties_the_batch_comes_back_empty():
    flat = [group(0, (C, 0.0), (C, 0.0)), group(1, (C, 1.0), (F, 0.0))]
    got = asyncio.run(collect_groups(_rounds(flat, flat), want=2, max_rounds=2, drop_zero_std=True,
                                     accuracy_lo=0.0, accuracy_hi=1.0))
    assert got.groups == [] and got.rounds == 2 and got.removed["zero_std"] == 4


def test_reference_logprobs_travel_with_the_kept_rows():
    p, _ = update("simpletir")
    ref = torch.arange(p.rows.tokens_BT.numel(), dtype=torch.float32).view_as(p.rows.tokens_BT)
    u = build_update(p.rows, p.rows.engine_logprobs_BT, mode="simpletir", low_prob_fraction=0.0, ref_logprobs_BT=ref)
    torch.testing.assert_close(u.batch.extras["ref_logprobs_BT"], ref)


def test_the_group_filter_reads_summaries_and_void_rows_count_in_group_statistics():
    # group 0: one correct, one void (reward 0): std > 0 only because the void row counts
    kept, removed = filter_groups([group(0, (C, 1.0), (V, 0.0)), group(1, (C, 1.0), (F, 0.0))], drop_zero_std=True,
                                  accuracy_lo=0.0, accuracy_hi=1.0)
    assert [g.group_id for g in kept] == [0] and removed["zero_std"] == 1  # group 1's tool failure does not count


def test_rows_are_dealt_per_mini_batch_longest_first_and_an_empty_share_gets_a_stand_in():
    groups = [group(0, (C, 1.0, (-1.0,) * 5), (C, 0.0, (-1.0,) * 2)), group(1, (C, 1.0, (-1.0,) * 3), (C, 0.0))]
    p = plan_update(collate(groups, pad_id=0), mode="simpletir", advantage="grpo", overlong="mask", mini_batches=2)
    a, b = deal_rows(p.rows, 2)
    # mini-batch 0 = group 0 (rows of 5 and 2 tokens), mini-batch 1 = group 1 (3 and 3 tokens)
    assert a.mini_batch_B.tolist() == [0, 1] and b.mini_batch_B.tolist() == [0, 1]
    assert a.attention_mask_BT.sum(1).tolist() == [7, 5] and b.attention_mask_BT.sum(1).tolist() == [4, 5]
    assert a.tokens_BT.shape[1] == 7 and b.tokens_BT.shape[1] == 5  # each share padded to its own longest row
    lone = plan_update(collate([group(0, (C, 1.0), (C, 0.0))], pad_id=0), mode="simpletir", advantage="grpo",
                       overlong="mask", mini_batches=1)
    shares = deal_rows(lone.rows, 3)
    assert [s.batch_size for s in shares] == [1, 1, 1] and float(shares[2].loss_mask_BT.sum()) == 0.0


def _too_long(gid: int, n: int):
    """A group whose prompt the engine refused: reward 0, no response tokens (as the driver leaves it)."""
    trajs = [Trajectory(group_id=gid, sample_index=i, prompt_ids=[1, 2]) for i in range(n)]
    for t in trajs:
        t.status, t.reward = FinishStatus.PROMPT_TOO_LONG, 0.0
    return Group(group_id=gid, problem=None, trajectories=trajs)


def test_prompt_too_long_rows_count_nowhere():
    """A data error is not a reward of 0: such rows enter neither a group's statistics nor the loss, and a
    group of only such rows is dropped (no counted rows), not kept with zero advantages."""
    mixed = _too_long(0, 2)  # the rule on a mixed group (the driver refuses a prompt for all its samples)
    mixed.trajectories[:0] = group(0, (C, 1.0), (C, 0.0)).trajectories
    for i, t in enumerate(mixed.trajectories):
        t.sample_index = i
    groups = [mixed, _too_long(1, 2)]
    plan = plan_update(collate(groups, pad_id=0), mode="simpletir", advantage="grpo", overlong="mask",
                       mini_batches=1)
    assert plan.stats_B.tolist() == [True, True, False, False, False, False]
    assert plan.trained_B.tolist() == [True, True, False, False, False, False]
    # GRPO over {1, 0}: +-0.5 / sqrt(1/2) (with the two zeros counted it would be 1.5 and -0.5)
    torch.testing.assert_close(plan.advantages_B, torch.tensor([0.7071, -0.7071, 0, 0, 0, 0]), atol=1e-4, rtol=0)
    kept, removed = filter_groups(groups, drop_zero_std=False, accuracy_lo=0.0, accuracy_hi=1.0)
    assert [g.group_id for g in kept] == [0] and removed["no_counted_rows"] == 1

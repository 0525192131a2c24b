"""The update batch of each Table-2 mode on crafted groups; dynamic sampling refills or comes back empty."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from crafted_rollouts import A, C, F, T, V, group

from megatron_tir.train.batch import (
    build_update,
    collect_groups,
    mini_batches,
    to_tensors,
)

S3 = math.sqrt(1 / 3)


def crafted():
    # group 0: correct, void, wrong, tool-failed(reward 1, must not count); group 1: correct, truncated, 2 wrong
    return [group(0, (C, 1.0), (V, 0.0), (C, 0.0), (F, 1.0)), group(1, (C, 1.0), (T, 0.0), (C, 0.0), (A, 0.0))]


def update(mode, overlong="mask", fraction=0.0):
    rt = to_tensors(crafted(), pad_id=0)
    return rt, build_update(rt, rt.engine_logprobs_BT, mode=mode, advantage="grpo",
                            overlong=overlong, low_prob_fraction=fraction)


def test_simpletir_void_in_stats_not_in_loss_infra_in_neither():
    _, u = update("simpletir")
    # group 0 stats {1, 0, 0} (tool-failed out): A = (2/3)/sqrt(1/3), (-1/3)/sqrt(1/3); group 1 {1, 0, 0}
    # (aborted out, truncated in): the same numbers
    a, b = (2 / 3) / S3, (-1 / 3) / S3
    torch.testing.assert_close(u.advantages_B, torch.tensor([a, b, b, 0, a, b, b, 0]), atol=1e-4, rtol=0)
    assert u.stats_B.tolist() == [True, True, True, False, True, True, True, False]
    assert u.loss_B.tolist() == [True, False, True, False, True, False, True, False]
    assert u.batch.tokens_BT.shape[0] == 4  # rows without loss tokens are not sent to the learner
    # loss tokens: the 3 sampled response tokens (columns 2..4), never the prompt
    assert u.batch.loss_mask_BT.tolist() == [[0, 0, 1, 1, 1]] * 4
    torch.testing.assert_close(u.batch.extras["advantages_BT"][:, 2], torch.tensor([a, b, a, b]), atol=1e-4, rtol=0)
    torch.testing.assert_close(u.batch.extras["old_logprobs_BT"][0], torch.tensor([0, 0, -0.5, -1.0, -2.0]))


@pytest.mark.parametrize("mode", ["naive", "stop_without_filter", "high_ratio_filter"])
def test_modes_without_void_filter_train_on_void_rows(mode):
    _, u = update(mode)
    assert u.loss_B.tolist() == [True, True, True, False, True, False, True, False]
    assert u.batch.tokens_BT.shape[0] == 5


def test_overlong_keep_trains_on_truncated_rows():
    _, u = update("simpletir", overlong="keep")
    assert u.loss_B.tolist() == [True, False, True, False, True, True, True, False]


def test_low_prob_filter_masks_each_rows_lowest_tokens():
    _, u = update("low_prob_filter", fraction=0.34)  # ceil(0.34 * 3) = 2 of each row's 3 tokens
    assert u.batch.loss_mask_BT.tolist() == [[0, 0, 1, 0, 0]] * 5
    assert u.low_prob_masked == 10


def test_reinforce_pp_uses_batch_statistics():
    rt = to_tensors(crafted(), pad_id=0)
    u = build_update(rt, rt.engine_logprobs_BT, mode="simpletir", advantage="reinforce_pp",
                     overlong="mask", low_prob_fraction=0.0)
    # counted rows: rewards {1, 0, 0, 1, 0, 0} x 3 tokens each: mean 1/3, std over 18 tokens sqrt((6*4/9 + 12/9)/17)
    std = math.sqrt((6 * 4 / 9 + 12 * 1 / 9) / 17)
    assert u.advantages_B[0].item() == pytest.approx((2 / 3) / std, abs=1e-4)
    assert u.advantages_B[3].item() == 0.0


def test_mini_batches_split_whole_groups():
    _, u = update("stop_without_filter")
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
    rt = to_tensors(crafted(), pad_id=0)
    ref = torch.arange(rt.tokens_BT.numel(), dtype=torch.float32).view_as(rt.tokens_BT)
    u = build_update(rt, rt.engine_logprobs_BT, mode="simpletir", advantage="grpo",
                     overlong="mask", low_prob_fraction=0.0, ref_logprobs_BT=ref)
    torch.testing.assert_close(u.batch.extras["ref_logprobs_BT"], ref[u.loss_B])

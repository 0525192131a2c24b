"""ZeroTIR's filters against its fork's rules (yyht/openrlhf_async_pipline 63b6159,
``openrlhf/trainer/ppo_utils/replay_buffer.py``), each rule written out here:

* ``filter_acc``: ``acc = mean(answer_rewards == 1.0)`` over a prompt's ``n_samples_per_prompt`` rows;
  kept when ``1 / n <= acc <= 0.8`` (``accuracy_lower_bound`` / ``accuracy_upper_bound``);
* ``filter_eval_fail``: a row leaves when ``rule_eval_fails > 0 or model_eval_fails > 0`` or
  ``repeatness > 0.05``;
* both run only once the actor trains (``ppo_trainer.py``: ``steps > freezing_actor_steps``).
"""

from __future__ import annotations

import random

import numpy as np
import torch
from crafted_rollouts import C, T, traj

from megatron_tir.observe.zerotir import repeat_score
from megatron_tir.reward.math_verify_reward import Verdict
from megatron_tir.rollout.batch import Group, collate
from megatron_tir.rollout.engines.base import FinishReason
from megatron_tir.rollout.trajectory import Turn
from megatron_tir.tir import TurnKind
from megatron_tir.train.batch import plan_update
from megatron_tir.train.recipes import load_recipe
from megatron_tir.train.row_filter import eval_filter_rules
from megatron_tir.train.sampling import filter_groups

N = 16


def _fork_filter_acc(rewards_GN: np.ndarray, n: int) -> np.ndarray:
    acc = (rewards_GN == 1.0).reshape(-1, n).astype(float).mean(-1)
    return (acc >= 1.0 / n) & (acc <= 0.8)


def _groups(seed: int, count: int = 200) -> tuple[list[Group], np.ndarray]:
    rng = random.Random(seed)
    groups, rewards = [], []
    for g in range(count):
        k = rng.choice([0, 0, 1, 2, 5, 8, 12, 13, 14, 15, 16, 16, rng.randint(0, N)])  # correct rows
        r = [1.0] * k + [0.0] * (N - k)
        rng.shuffle(r)
        # truncated rows too: the recipe keeps them (overlong keep), so they count as in the fork
        groups.append(Group(group_id=g, problem=None,
                            trajectories=[traj(g, i, T if rng.random() < 0.1 else C, r[i]) for i in range(N)]))
        rewards.append(r)
    return groups, np.array(rewards)


def test_accuracy_filter_is_the_forks():
    cfg = load_recipe("qwen2.5-7b-zerotir").trainer.filters
    groups, rewards = _groups(0)
    want = _fork_filter_acc(rewards, N)
    kept, removed = filter_groups(groups, drop_zero_std=cfg.drop_zero_std, accuracy_lo=cfg.accuracy_lo,
                                  accuracy_hi=cfg.accuracy_hi, overlong=cfg.overlong, min_rows=cfg.min_group_rows)
    assert [g.group_id for g in kept] == [g for g in range(len(groups)) if want[g]]
    assert 0 < len(kept) < len(groups) and removed["accuracy"] + removed["zero_std"] == len(groups) - len(kept)
    # the fork's bounds are not "drop 0/16 and 16/16": 13/16 = 0.8125 > 0.8 is dropped, 1/16 kept
    by_k = {int(r.sum()): bool(w) for r, w in zip(rewards, want)}
    assert by_k[1] and not by_k[13] and by_k[12] and not by_k[0] and not by_k[16]


def _with_text(t, text: str, failed: bool = False):
    t.turns.append(Turn(index=0, kind=TurnKind.ANSWER, reason="answer", finish_reason=FinishReason.STOP, start=0,
                        model_tokens=len(t.response_ids), text=text))
    t.reward_failed = failed
    return t


def test_eval_filter_is_the_forks_and_leaves_the_loss_only():
    prose = "We add the two numbers and then check the sum against the bound, so the answer is \\boxed{7}."
    looping = "so the answer is " * 40
    texts = [prose, looping, prose, prose]
    failed = [False, False, True, False]
    rows = [_with_text(traj(0, i, C, float(i % 2)), x, f) for i, (x, f) in enumerate(zip(texts, failed))]
    scores = [repeat_score(x) for x in texts]
    assert scores[0] < 0.05 < scores[1]
    want = [f or s > 0.05 for f, s in zip(failed, scores)]  # filter_eval_fail
    rules = eval_filter_rules(rows, max_repeat_score=0.05, drop_verifier_failures=True)
    assert rules == [None, "repeats", "verifier_failed", None]
    got = torch.tensor([r is not None for r in rules], dtype=torch.bool)  # the producer's excluded_B
    assert got.tolist() == want == [False, True, True, False]
    assert eval_filter_rules(rows, max_repeat_score=None, drop_verifier_failures=False) is None
    assert [r is not None for r in eval_filter_rules(rows, max_repeat_score=None, drop_verifier_failures=True)] \
        == failed
    plan = plan_update(collate([Group(group_id=0, problem=None, trajectories=rows)], pad_id=0), mode="naive",
                       advantage="grpo", overlong="keep", mini_batches=1, excluded_B=got)
    assert plan.trained_B.tolist() == [True, False, False, True]
    assert plan.stats_B.tolist() == [True] * 4  # still in the group's statistics (read before, as the fork's order)
    assert torch.equal(plan.rows.loss_mask_BT.sum(1) > 0, torch.tensor([True, True]))


def test_verifier_failure_is_the_checks_not_the_answers():
    assert Verdict(correct=False, timed_out=True).failed
    assert Verdict(correct=False, error="worker died: EOF").failed
    assert Verdict(correct=False, error="ValueError: bad latex").failed
    assert not Verdict(correct=False, error="no final answer").failed and not Verdict(correct=True).failed

"""``trainer.async.correction=mask`` can mask every token of a mini-batch (each behaviour weight over
the cap): that mini-batch is an empty step, counted, and the update goes on with the others (before:
the learner raised and the run crashed)."""

from __future__ import annotations

import pytest
import torch
from crafted_rollouts import C, group

from megatron_tir.train.config import apply_overrides
from megatron_tir.train.recipes import tiny_cpu
from megatron_tir.train.batch import StepRollouts


@pytest.fixture(scope="module")
def parallel_1x1():
    from megatron_tir.policy.parallel import destroy_parallel, init_parallel

    init_parallel(1, 1)
    yield
    destroy_parallel()


def test_a_mini_batch_the_correction_masks_whole_is_an_empty_step(parallel_1x1):
    from megatron_tir.policy.learner import Learner
    from megatron_tir.train.algorithm import build_algorithm

    cfg = apply_overrides(tiny_cpu(), ["trainer.async=one_step", "trainer.async.correction=mask",
                                       "trainer.async.cap=2", "trainer.ppo.mini_batches=2", "trainer.ppo.epochs=1",
                                       "trainer.loss.entropy_coef=0"])
    learner = Learner(cfg.learner)
    # group 0: engine log-probs far below the learner's (~ -log vocab): weight e^(prox - behav) >> cap, all masked;
    # group 1: far above them: weight << cap, all kept
    groups = [group(0, (C, 1.0, (-60.0, -60.0, -60.0)), (C, 0.0, (-60.0, -60.0, -60.0))),
              group(1, (C, 1.0, (-0.1, -0.2, -0.3)), (C, 0.0, (-0.2, -0.1, -0.3)))]
    got = StepRollouts.of_groups(groups, cfg)
    assert got.mini_batches == 2 and got.rows.mini_batch_B.tolist().count(0) == 2
    before = [p.detach().clone() for p in learner.module.parameters()]
    metrics = build_algorithm(cfg, learner).update(1, got, {}).metrics
    assert metrics["train/optimizer_steps"] == 2.0 and metrics["train/empty_steps"] == 1.0
    assert metrics["train/skipped_steps"] == 0.0 and learner.step == 1  # the other mini-batch stepped
    assert metrics["offpolicy/capped_share"] == pytest.approx(0.5)  # half the loss tokens (group 0's) masked
    assert metrics["train/loss"] != 0.0 and metrics["train/grad_norm"] > 0  # the trained step's, not diluted
    assert any(not torch.equal(p, b) for p, b in zip(learner.module.parameters(), before))

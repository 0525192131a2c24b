"""A mini-batch whose loss mask selects no token (the off-policy correction's ``mask`` mode can mask
every one): an ``empty`` step on every rank -- no forward, no optimizer step, weights untouched --
at PP=1 and at PP=2, where the first stage holds no loss mask and learns the count from the last
(before: the last stage raised and the first blocked in its pipeline send)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from learner_testing import make_batch, ppo_loss

from megatron_tir.policy.learner_config import LearnerConfig
from megatron_tir.policy.parallel import run_ranks


def _learner(pp: int = 1):
    from megatron_tir.policy.learner import Learner

    return Learner(LearnerConfig(model="tiny-qwen2", pp=pp, lr=1e-3))


def _empty_then_real(learner, *, loss_mask_here: bool) -> dict:
    """An all-masked step, then a real one (the ranks are still in step); what each did."""
    from megatron.core import parallel_state

    batch = make_batch(0)
    before = [p.detach().clone() for p in learner.module.parameters()]
    masked = dataclasses.replace(batch, loss_mask_BT=torch.zeros_like(batch.loss_mask_BT) if loss_mask_here else None)
    empty = learner.train_step(masked, ppo_loss, local_rows=True)
    unchanged = all(torch.equal(p, b) for p, b in zip(learner.module.parameters(), before))
    steps_after_empty = learner.step
    real = learner.train_step(batch if loss_mask_here else dataclasses.replace(batch, loss_mask_BT=None),
                              ppo_loss, local_rows=True)
    changed = any(not torch.equal(p, b) for p, b in zip(learner.module.parameters(), before))
    return {"stage": parallel_state.get_pipeline_model_parallel_rank(), "empty": empty.empty,
            "skipped": empty.skipped, "loss": empty.loss, "unchanged": unchanged,
            "steps_after_empty": steps_after_empty, "real_empty": real.empty, "real_loss": real.loss,
            "steps_after_real": learner.step, "changed": changed}


def test_an_all_masked_mini_batch_is_an_empty_step(parallel_1x1):
    learner = _learner()
    r = _empty_then_real(learner, loss_mask_here=True)
    assert r["empty"] and not r["skipped"] and r["loss"] == 0.0
    assert r["unchanged"] and r["steps_after_empty"] == 0
    assert not r["real_empty"] and r["real_loss"] != 0.0 and r["steps_after_real"] == 1 and r["changed"]
    # the same without local_rows (the whole batch on this rank)
    batch = make_batch(1)
    result = learner.train_step(dataclasses.replace(batch, loss_mask_BT=torch.zeros_like(batch.loss_mask_BT)), ppo_loss)
    assert result.empty and learner.step == 1


def empty_run(rank: int, world: int, out: str) -> None:
    from megatron.core import parallel_state

    from megatron_tir.policy.parallel import init_parallel

    init_parallel(1, 2, timeout_s=60.0)  # a rank blocked in the pipeline fails in a minute, not ten
    learner = _learner(pp=2)
    r = _empty_then_real(learner, loss_mask_here=parallel_state.is_pipeline_last_stage())
    torch.save(r, f"{out}.{rank}")


@pytest.mark.slow
def test_an_all_masked_mini_batch_is_an_empty_step_on_every_pipeline_stage(tmp_path):
    """PP=2 over gloo, two spawned ranks (~30 s): both stages return ``empty`` and keep their
    weights; the next (real) step runs the pipeline on both and changes them."""
    out = tmp_path / "empty"
    run_ranks(empty_run, 2, str(out))
    results = [torch.load(f"{out}.{rank}") for rank in range(2)]
    assert sorted(r["stage"] for r in results) == [0, 1]
    for r in results:
        assert r["empty"] and not r["skipped"] and r["unchanged"] and r["steps_after_empty"] == 0, r
        assert not r["real_empty"] and r["steps_after_real"] == 1 and r["changed"], r
    last = next(r for r in results if r["stage"] == 1)
    assert last["real_loss"] != 0.0

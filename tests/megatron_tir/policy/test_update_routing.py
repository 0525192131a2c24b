"""Routing replay in the update (``trainer.ppo.routing_replay``, ``policy.routing.UpdateRouting``) on the
tiny Qwen3-MoE: the old pass's record is handed to each mini-batch's rows (split further into several
micro-batches by the token budget) and the update's routers choose exactly the recorded experts; with
replay off the update routes freely and the top-k changed share is reported, equal to a count made
here from the two passes' choices; a rollout record routes its known tokens to arbitrary experts and
leaves the unknown (-1) ones to the router; under PP each stage replays its own layer."""

from __future__ import annotations

import pytest
import torch
from learner_testing import make_batch, ppo_loss

from megatron_tir.policy.learner_contract import TrainBatch
from megatron_tir.policy.routing import UpdateRouting, update_routing

TINY = "tiny-qwen3-moe"
RECOMPUTE_ALL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
MINI_B = torch.tensor([2, 0, 1, 0, 2, 1])  # mini-batch of each of the 6 rows (rows interleaved, as groups may be)


@pytest.fixture
def learner(parallel_1x1):
    from megatron_tir.policy.learner import Learner
    from megatron_tir.policy.learner_config import LearnerConfig

    return Learner(LearnerConfig(model=TINY, lr=5e-2, max_tokens_per_microbatch=20))  # 2+ micro-batches each


def _rows(batch: TrainBatch, select_B: torch.Tensor) -> TrainBatch:
    """The rows ``train.batch.mini_batches`` gives a mini-batch (a boolean selection, in order)."""
    return TrainBatch(tokens_BT=batch.tokens_BT[select_B], attention_mask_BT=batch.attention_mask_BT[select_B],
                      loss_mask_BT=batch.loss_mask_BT[select_B], extras={k: v[select_B] for k, v in batch.extras.items()})


def _update(learner, routing: UpdateRouting, batch: TrainBatch) -> list[torch.Tensor]:
    """Three mini-batch steps as ``PolicyGradient.update`` runs them; the routing each step used."""
    used = []
    for k in range(3):
        select = MINI_B == k
        with routing.mini_batch(select):
            learner.train_step(_rows(batch, select), ppo_loss)
        used.append(learner.routing.recorded.clone())
    return used


def test_old_pass_routing_is_replayed_in_every_mini_batch(learner):
    batch = make_batch(7, rows=6)
    learner.logprobs(batch.tokens_BT, batch.attention_mask_BT, local_rows=True)  # the old-log-prob pass
    record = learner.routing.recorded.clone()
    routing = UpdateRouting(learner.routing, "old_pass")
    routing.start(old_pass=True)
    used = _update(learner, routing, batch)
    for k in range(3):  # the routers' choices (the experts the tokens were sent to) are the recorded ones
        assert torch.equal(used[k], record[MINI_B == k])
    share = routing.finish()["routing/topk_changed_share"]
    print(f"old_pass replay: router top-k changed for {share:.3f} of (token, layer) pairs")
    assert 0 < share < 1  # the later mini-batches ran on moved routers: their own top-k differs


def test_without_replay_the_changed_share_is_reported(learner):
    batch = make_batch(7, rows=6)
    learner.logprobs(batch.tokens_BT, batch.attention_mask_BT, local_rows=True)
    record = learner.routing.recorded.clone()
    routing = update_routing(learner, "none")
    routing.start(old_pass=True)
    used = _update(learner, routing, batch)
    changed = pairs = 0
    for k in range(3):  # counted here from the two passes' choices (routed freely, the choice is the top-k)
        real = batch.attention_mask_BT[MINI_B == k]
        changed += int((used[k][real] != record[MINI_B == k][real]).any(dim=-1).sum())
        pairs += int(real.sum()) * record.shape[2]
    assert torch.equal(used[0], record[MINI_B == 0])  # the first step: the old pass's weights
    assert changed > 0 and not torch.equal(used[2], record[MINI_B == 2])
    assert routing.finish() == {"routing/topk_changed_share": pytest.approx(changed / pairs)}


def test_a_rollout_record_routes_known_tokens_and_leaves_the_rest_to_the_router(learner):
    batch = make_batch(7, rows=6)
    g = torch.Generator().manual_seed(0)
    rollout = torch.rand(6, 16, 2, 8, generator=g).argsort(dim=-1)[..., :2].to(torch.int32)  # any 2 of 8 experts
    rollout[:, -4:] = -1  # tokens the engine reported nothing for (the sequence's last one, say)
    routing = UpdateRouting(learner.routing, "rollout")
    routing.start(old_pass=True, rollout_BTX=rollout.flatten(2))
    used = _update(learner, routing, batch)
    for k in range(3):
        real = batch.attention_mask_BT[MINI_B == k].clone()
        real[:, -4:] = False
        want = rollout[MINI_B == k].long().sort(dim=-1).values
        assert torch.equal(used[k][real].long(), want[real])
    assert 0 < routing.finish()["routing/topk_changed_share"] < 1  # random experts: mostly not the router's


def test_bad_settings_are_refused(learner):
    with pytest.raises(ValueError, match="routing replay must be one of"):
        UpdateRouting(learner.routing, "old-pass")
    with pytest.raises(ValueError, match="needs an MoE policy"):
        update_routing(object(), "old_pass")
    assert update_routing(object(), "none") is None
    routing = UpdateRouting(learner.routing, "rollout")
    with pytest.raises(ValueError, match="carry no rollout routing"):
        routing.start(old_pass=True)
    with pytest.raises(ValueError, match=r"rollout routing has 1 layers"):
        routing.start(old_pass=True, rollout_BTX=torch.zeros(6, 16, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"must be \[B, T, layers x 2\]"):
        routing.start(old_pass=True, rollout_BTX=torch.zeros(6, 16, 3, dtype=torch.int32))


def _pp_run(rank: int, world: int, out: str) -> None:
    from megatron_tir.policy.learner import Learner
    from megatron_tir.policy.learner_config import LearnerConfig
    from megatron_tir.policy.parallel import init_parallel
    from megatron.core import parallel_state

    init_parallel(1, 2)
    learner = Learner(LearnerConfig(model=TINY, lr=5e-2, pp=2, max_tokens_per_microbatch=20))
    batch = make_batch(7, rows=6)
    g = torch.Generator().manual_seed(0)
    rollout = torch.rand(6, 16, 2, 8, generator=g).argsort(dim=-1)[..., :2].to(torch.int32)
    routing = UpdateRouting(learner.routing, "rollout")
    routing.start(old_pass=False, rollout_BTX=rollout.flatten(2))
    stage = parallel_state.get_pipeline_model_parallel_rank()
    mine = batch if stage == 1 else TrainBatch(tokens_BT=batch.tokens_BT, attention_mask_BT=batch.attention_mask_BT,
                                               loss_mask_BT=None)
    used = []
    for k in range(3):
        select = MINI_B == k
        with routing.mini_batch(select):
            learner.train_step(_rows(mine, select) if stage == 1 else TrainBatch(
                tokens_BT=mine.tokens_BT[select], attention_mask_BT=mine.attention_mask_BT[select], loss_mask_BT=None),
                ppo_loss, local_rows=True)
        used.append(learner.routing.recorded.clone())
    metrics = routing.finish()
    steps = []  # one replayed step of all rows (several micro-batches in flight under 1F1B), without and with
    for memory in ({}, RECOMPUTE_ALL):  # recomputation: the recomputed layers replay their forward's targets
        fresh = Learner(LearnerConfig(model=TINY, lr=5e-2, pp=2, max_tokens_per_microbatch=20, **memory))
        replay = UpdateRouting(fresh.routing, "rollout")
        replay.start(old_pass=False, rollout_BTX=rollout.flatten(2))
        with replay.mini_batch(torch.ones(6, dtype=torch.bool)):
            steps.append(fresh.train_step(mine, ppo_loss, local_rows=True).grad_norm)
    torch.save({"layers": learner.routing.layer_numbers, "used": used, "metrics": metrics, "grad_norms": steps},
               f"{out}.{stage}")


@pytest.mark.slow
def test_under_pp_each_stage_replays_its_own_layer(tmp_path):
    from megatron_tir.policy.parallel import run_ranks

    run_ranks(_pp_run, 2, str(tmp_path / "r"))
    batch = make_batch(7, rows=6)
    g = torch.Generator().manual_seed(0)
    rollout = torch.rand(6, 16, 2, 8, generator=g).argsort(dim=-1)[..., :2].long().sort(dim=-1).values
    for stage in (0, 1):
        got = torch.load(f"{tmp_path / 'r'}.{stage}")
        assert got["layers"] == [stage + 1]  # one layer a stage, numbered in the whole model
        for k in range(3):
            real = batch.attention_mask_BT[MINI_B == k]
            assert torch.equal(got["used"][k][real][:, 0].long(), rollout[MINI_B == k][real][:, stage])
        assert 0 < got["metrics"]["routing/topk_changed_share"] < 1  # the same on both stages (summed over them)
        plain, recomputed = got["grad_norms"]
        assert recomputed == pytest.approx(plain, rel=1e-4)


def test_full_recomputation_replays_the_forwards_routing(parallel_1x1):
    """The same replayed update with every layer recomputed in backward: the forward routes to the record
    and so does the recomputation (else its activations, and the gradient, would differ)."""
    from megatron_tir.policy.learner import Learner
    from megatron_tir.policy.learner_config import LearnerConfig

    batch = make_batch(7, rows=6)
    g = torch.Generator().manual_seed(0)
    record = torch.rand(6, 16, 2, 8, generator=g).argsort(dim=-1)[..., :2].to(torch.int16)  # not the router's
    results = {}
    for name, memory in (("plain", {}), ("recompute", RECOMPUTE_ALL)):
        learner = Learner(LearnerConfig(model=TINY, lr=5e-2, max_tokens_per_microbatch=20, **memory))
        with learner.routing.replaying(record.long()):
            step = learner.train_step(batch, ppo_loss)
        results[name] = (step, learner.routing.recorded.clone())
    free = Learner(LearnerConfig(model=TINY, lr=5e-2, max_tokens_per_microbatch=20, **RECOMPUTE_ALL)).train_step(
        batch, ppo_loss)
    (plain, used_plain), (again, used_again) = results["plain"], results["recompute"]
    real = batch.attention_mask_BT
    assert torch.equal(used_again[real], record[real].long().sort(dim=-1).values.to(torch.int16))
    assert torch.equal(used_plain, used_again)
    assert again.loss == pytest.approx(plain.loss, rel=1e-5) and again.grad_norm == pytest.approx(plain.grad_norm,
                                                                                                rel=1e-4)
    assert free.grad_norm != pytest.approx(again.grad_norm, rel=1e-3)  # free routing trains another sub-network


def test_replay_refuses_a_partly_recomputed_stage(parallel_1x1):
    from megatron_tir.policy.learner import Learner
    from megatron_tir.policy.learner_config import LearnerConfig

    learner = Learner(LearnerConfig(model=TINY, recompute_granularity="full", recompute_method="block",
                                    recompute_num_layers=1))  # one of the two layers
    with pytest.raises(ValueError, match="needs every layer recomputed"):
        with learner.routing.replaying(torch.zeros(6, 16, 2, 2, dtype=torch.int16)):
            pass

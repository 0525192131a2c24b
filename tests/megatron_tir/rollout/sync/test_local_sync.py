"""LocalWeightSync and the weight versions of sampled tokens, with the in-process LocalEngine.

Independent reference for a token's version: its engine log-prob equals a plain
transformers forward pass under *that* version's weights (and not under the others'). A
RETRACT pause re-prefills requests in flight under the new weights, so a trajectory that
straddles syncs is, token by token, exactly what the weights of its recorded version sample.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from megatron_tir.data import Problem
from megatron_tir.rollout import RolloutConfig, TIRRollout, collate
from megatron_tir.rollout.batch import weight_version_metrics
from megatron_tir.rollout.engines.base import PauseMode
from megatron_tir.rollout.engines.local import LocalEngine, LocalEngineConfig
from megatron_tir.rollout.sync import buckets_of
from megatron_tir.rollout.sync.local import LocalWeightSync
from version_testing import check_versions_against_weights, weight_sets

PROBLEM = Problem(index=0, messages=({"role": "user", "content": "What is 6 times 7?"},), ground_truth="42")


@pytest.fixture(scope="module")
def tiny_dir(make_tiny_hf):
    return make_tiny_hf("qwen2", tie_word_embeddings=False)


def test_every_trained_tokens_version_is_the_weights_that_sampled_it(tiny_dir):
    sets = weight_sets(tiny_dir, 3)
    cfg = RolloutConfig(n_samples=3, max_turns=1, max_response_tokens=240, tools=False, seed=4)

    async def main():
        engine = LocalEngine(LocalEngineConfig(model=str(tiny_dir), eos_token_ids=(0,), seed=0))
        sync = LocalWeightSync(engine, pause_mode=PauseMode.RETRACT)
        await sync.start()
        steps = [0]  # the engine's decode steps so far, counted on its worker thread (a test-only wrapper)
        step = engine._step

        def counted(admitted):
            steps[0] += 1
            return step(admitted)

        engine._step = counted
        driver = TIRRollout(engine, engine.tokenizer, None, cfg)
        rollout = asyncio.create_task(driver.run([PROBLEM]))
        seen = [engine.weight_version]
        for k, weights in enumerate(sets[1:], start=1):
            while steps[0] < 16 * k and not rollout.done():  # tokens sampled under each version (a sleep raced an idle machine)
                await asyncio.sleep(0.005)
            seen.append(await sync.update(buckets_of(weights, 64 << 10)))
        groups = await rollout
        await sync.close()
        await engine.close()
        return seen, engine.weight_version, groups

    seen, final, groups = asyncio.run(asyncio.wait_for(main(), 300))
    assert seen == [0, 1, 2] and final == 2
    for t in groups[0].trajectories:
        assert t.reward is None and len(t.response_versions) == len(t.response_ids)
    for g in groups:
        for t in g.trajectories:
            t.reward = 0.0
    batch = collate(groups, pad_id=0)
    check_versions_against_weights(batch, tiny_dir, sets)
    rows = [batch.versions_BT[b][batch.loss_mask_BT[b] > 0] for b in range(batch.batch_size)]
    assert all((r[1:] >= r[:-1]).all() for r in rows)  # a trajectory's versions only go up
    assert any(len(set(r.tolist())) > 1 for r in rows)  # and a trajectory did straddle a sync
    metrics = weight_version_metrics(batch.versions_BT, batch.loss_mask_BT, current=final)
    assert metrics["train/weight_version_min"] == 0 and metrics["train/weight_version_max"] == 2
    assert metrics["train/weight_version_lag_max"] == 2 and 0 < metrics["train/weight_version_stale_share"] < 1


def test_a_failed_update_leaves_the_version_and_resumes_generation(tiny_dir):
    async def main():
        engine = LocalEngine(LocalEngineConfig(model=str(tiny_dir), eos_token_ids=(0,)))
        sync = LocalWeightSync(engine)
        with pytest.raises(ValueError, match="model.norm.weight has shape"):
            await sync.update([(0, [("model.norm.weight", torch.zeros(3))])])
        with pytest.raises(ValueError, match="a bucket is \\(stage"):
            await sync.update([[("model.norm.weight", torch.zeros(64))]])
        from megatron_tir.rollout.engines.base import SamplingParams

        out = await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=3, seed=0))
        version = engine.weight_version
        await engine.close()
        return out, version

    out, version = asyncio.run(asyncio.wait_for(main(), 120))
    assert version == 0 and out.versions == [0, 0, 0] and len(out.token_ids) == 3


def test_weight_version_metrics_refuse_tokens_without_a_version():
    versions = torch.tensor([[-1, 3, 4, -1]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    assert weight_version_metrics(versions, mask) == {"train/weight_version_min": 3.0,
                                                      "train/weight_version_max": 4.0}
    lag = weight_version_metrics(versions, mask, current=4)
    assert lag["train/weight_version_lag_mean"] == 0.5 and lag["train/weight_version_stale_share"] == 0.5
    with pytest.raises(ValueError, match="no weight version"):
        weight_version_metrics(versions, torch.ones(1, 4))


def test_weight_version_lag_histogram_of_the_trained_tokens():
    versions = torch.tensor([[-1, 3, 4, 4, 1, 1]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0, 1.0, 0.0]])  # trained: versions 3, 4, 4, 1
    hist = {k: v for k, v in weight_version_metrics(versions, mask, current=4).items() if "lag_share" in k}
    assert hist == {"train/weight_version_lag_share_0": 0.5, "train/weight_version_lag_share_1": 0.25,
                    "train/weight_version_lag_share_2": 0.0, "train/weight_version_lag_share_3": 0.25}
    far = weight_version_metrics(torch.tensor([[0, 30]]), torch.ones(1, 2), current=30)
    assert far["train/weight_version_lag_share_0"] == 0.5 and far["train/weight_version_lag_share_16"] == 0.5
    assert "train/weight_version_lag_share_17" not in far

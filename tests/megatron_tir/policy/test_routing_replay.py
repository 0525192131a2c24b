"""MoE routing record and replay in the learner (tiny Qwen3-MoE, TP=1): the recorded experts are
transformers' top-k (``output_router_logits``); after an update has moved the router, a replayed
update routes every token to the recorded experts while the router's own top-k differs (the
"top-k changed" share is reported), and a free pass reports the same share against the record."""

from __future__ import annotations

import pytest
import torch
from learner_testing import make_batch, ppo_loss

TINY = "tiny-qwen3-moe"


@pytest.fixture(scope="module")
def learner(parallel_1x1):
    from megatron_tir.policy.learner import Learner
    from megatron_tir.policy.learner_config import LearnerConfig

    return Learner(LearnerConfig(model=TINY, lr=5e-2, max_tokens_per_microbatch=24))


def _hf_topk(tokens_BT, mask_BT) -> torch.Tensor:
    """transformers' experts per token and layer, ``[B, T, layers, k]`` sorted (-1 on padding)."""
    from transformers import AutoModelForCausalLM

    from megatron_tir.model_sources import resolve_model

    model = AutoModelForCausalLM.from_pretrained(resolve_model(TINY), dtype=torch.float32).eval()
    k = model.config.num_experts_per_tok
    out = torch.full((*tokens_BT.shape, model.config.num_hidden_layers, k), -1, dtype=torch.long)
    with torch.no_grad():
        for b in range(tokens_BT.shape[0]):
            idx = mask_BT[b].nonzero().flatten()
            s, e = int(idx[0]), int(idx[-1]) + 1
            logits = model(tokens_BT[b:b + 1, s:e], output_router_logits=True).router_logits  # per layer [e-s, E]
            for layer, lg in enumerate(logits):
                out[b, s:e, layer] = lg.topk(k, dim=-1).indices.sort(dim=-1).values
    return out


def test_record_equals_transformers_and_replay_routes_to_the_record(learner):
    probe = make_batch(1)
    learner.logprobs(probe.tokens_BT, probe.attention_mask_BT)
    record = learner.routing.recorded.clone()
    assert record.shape == (*probe.tokens_BT.shape, 2, 2)
    assert (record[~probe.attention_mask_BT] == -1).all() and (record[probe.attention_mask_BT] >= 0).all()
    assert torch.equal(record.long(), _hf_topk(probe.tokens_BT, probe.attention_mask_BT))
    assert learner.routing.changed_share is None  # nothing to compare with

    for seed in (2, 3):  # a large step moves the router
        learner.train_step(make_batch(seed), ppo_loss)
    with learner.routing.compare_to(record):
        learner.logprobs(probe.tokens_BT, probe.attention_mask_BT)
    free, changed = learner.routing.recorded.clone(), learner.routing.changed_share
    real = probe.attention_mask_BT
    share = (free[real] != record[real]).any(dim=-1).float().mean().item()  # per (token, layer)
    print(f"routing: top-k changed for {changed:.3f} of (token, layer) pairs after two updates")
    assert 0 < changed < 1 and changed == pytest.approx(share)

    with learner.routing.replaying(record):
        learner.train_step(probe, ppo_loss)  # the old-pass routing, replayed in the update
    assert torch.equal(learner.routing.recorded, record)  # every token went to the recorded experts
    # the router's own choice still differs from the record (not by the free pass's share: past the first
    # layer the routers see what the replayed experts computed)
    assert 0 < learner.routing.changed_share < 1
    learner.logprobs(probe.tokens_BT, probe.attention_mask_BT)
    assert not torch.equal(learner.routing.recorded, record)  # outside the context: routed freely again


def test_a_record_of_another_batch_is_refused(learner):
    probe = make_batch(1)
    with pytest.raises(ValueError, match=r"\[B, T, 2, 2\]"):
        with learner.routing.replaying(torch.zeros(4, 16, 3, 2, dtype=torch.int16)):
            pass
    with pytest.raises(ValueError, match="does not fit"):
        with learner.routing.replaying(torch.zeros(3, 16, 2, 2, dtype=torch.int16)):
            learner.logprobs(probe.tokens_BT, probe.attention_mask_BT)


@pytest.mark.slow
def test_replay_at_ep2_with_rows_dealt_over_the_replicas(tmp_path):
    from qwen3_testing import routing_run

    from megatron_tir.policy.parallel import run_ranks

    run_ranks(routing_run, 2, 2, str(tmp_path / "r.pt"))
    got = torch.load(tmp_path / "r.pt")
    probe = make_batch(1)
    assert torch.equal(got["record"].long(), _hf_topk(probe.tokens_BT, probe.attention_mask_BT))  # both replicas' rows
    assert torch.equal(got["replayed"], got["record"]) and 0 < got["changed"] < 1

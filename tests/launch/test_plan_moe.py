"""The planner's MoE terms (Qwen3-30B-A3B, the recipe's TP 2 x EP 8 on the example H100 cluster) against
a hand computation from the model card's shapes: hidden 2048, 48 layers, 32 query / 4 KV heads of 128,
128 experts of width 768, 8 a token, vocab 151936, untied embeddings."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_tir.launch.model_facts import model_spec
from megatron_tir.launch.plan import GIB, ModelShape, learner_stages, plan_run

ROOT = Path(__file__).resolve().parents[2]

H, L, V, E, K, F = 2048, 48, 151936, 128, 8, 768
ATTENTION = H * (32 * 128 + 2 * 4 * 128) + 32 * 128 * H + 2 * H  # q, k, v, o and the two RMSNorms
ROUTER = H * E  # whole on every rank
EXPERT = 3 * H * F  # gate, up, down


def test_total_and_active_parameters_are_the_model_cards():
    m = ModelShape.of(model_spec("Qwen3-30B-A3B"))
    assert m.total_params == L * (ATTENTION + ROUTER + E * EXPERT) + 2 * V * H + H
    assert m.active_params == L * (ATTENTION + ROUTER + K * EXPERT) + 2 * V * H + H
    assert m.total_params / 1e9 == pytest.approx(30.5, abs=0.05)  # "30.5B in total and 3.3B activated"
    assert m.active_params / 1e9 == pytest.approx(3.3, abs=0.06)


def test_memory_of_a_gpu_at_tp2_ep8_by_hand():
    tp, ep, etp, dp, tokens = 2, 8, 2, 16, 32768
    (s,) = learner_stages(ModelShape.of(model_spec("Qwen3-30B-A3B")), tp=tp, pp=1, dp=dp, tokens=tokens,
                          dtype="bfloat16", sp=True, recompute="full", distributed_optimizer=True, ep=ep, etp=etp)
    experts = L * (E // ep) * EXPERT // etp  # 16 experts, each split over the 2 ETP ranks
    params = L * (ATTENTION // tp + ROUTER) + experts + 2 * V * H // tp + H
    assert (s.expert_params, s.params) == (experts, params) == (1_811_939_328, 2_588_772_352)
    assert s.param_bytes == 2 * params and s.grad_bytes == 4 * params  # bf16 weights, float32 gradient buffers
    edp = tp * dp // (ep * etp)  # 2 expert-data-parallel ranks hold each expert's Adam state
    assert s.optimizer_bytes == pytest.approx((params - experts) * 12 / dp + experts * 12 / edp)
    # the dispatcher: 8 copies of a token's hidden state (of the 1/2 of the sequence a rank holds), sent and
    # received, forward and backward, bf16
    assert s.dispatch_bytes == tokens * 4 * K * H / tp * 2 == 2 * GIB
    # one layer rebuilt by full recomputation: norms + attention, router logits, the 8 x 2 copies the
    # experts get (hidden + fc1 + SwiGLU of an ETP shard), the combine's expert outputs
    per_token = (4 * H / tp + (4096 + 1024) / tp + 4096 / tp + E / tp + K * etp / tp * (H + 3 * F / etp)
                 + K * H / tp)
    assert per_token == 42560
    assert s.recompute_bytes == tokens * per_token * 2
    assert s.peak_bytes == pytest.approx(s.static_bytes + s.activation_bytes + s.recompute_bytes
                                         + s.logits_bytes + s.dispatch_bytes)


def test_the_recipes_plan_is_moe_aware():
    from megatron_tir.launch.cluster import load_cluster
    from megatron_tir.train.recipes import load_recipe

    cfg = load_recipe("qwen3-30b-a3b-simpletir")
    cluster = load_cluster(ROOT / "launch" / "examples" / "h100.yaml")
    plan = plan_run(cfg, cluster)
    assert not plan.problems, plan.problems
    assert (plan.ep, plan.etp) == (8, 2)
    assert plan.sync_bytes == 2 * ModelShape.of(model_spec("Qwen3-30B-A3B")).total_params  # every expert travels
    assert "MoE: 16 of 128 experts per GPU (EP 8 x ETP 2)" in plan.table()
    cfg.learner.ep = 3
    bad = plan_run(cfg, cluster)
    assert "learner.ep=3 does not divide the model's 128 experts" in bad.problems
    assert any("does not divide the 32 ranks of a pipeline stage" in p for p in bad.problems)

"""The Qwen3 recipes: their models' shapes are known without a download (launch/model_facts.py), their
learner layouts split those models, and the dense one fits the example H100 cluster in the planner."""

from __future__ import annotations

import pytest

from megatron_tir.launch.model_facts import model_spec
from megatron_tir.train.recipes import load_recipe


@pytest.mark.parametrize("recipe,model,experts", [("qwen3-8b-simpletir", "Qwen3-8B", 0),
                                                  ("qwen3-30b-a3b-simpletir", "Qwen3-30B-A3B", 128)])
def test_recipe_layout_splits_its_model(recipe, model, experts):
    cfg = load_recipe(recipe)
    spec = model_spec(cfg.model)
    assert cfg.model == model and spec.num_experts == experts and spec.qk_layernorm and not spec.qkv_bias
    lc = cfg.learner
    spec.check_layout(lc.tp, lc.pp, lc.ep)  # ValueError if the layout does not split the model
    assert lc.dtype == "bfloat16" and lc.sequence_parallel
    if experts:  # megatron-core's MoE layer trains under TP only with sequence parallelism
        assert lc.ep > 1 and spec.num_experts % lc.ep == 0 and spec.moe_router_topk == 8 and spec.norm_topk_prob


def test_the_dense_recipe_fits_the_example_cluster():
    from megatron_tir.launch.cluster import load_cluster
    from megatron_tir.launch.plan import plan_run

    plan = plan_run(load_recipe("qwen3-8b-simpletir"), load_cluster("launch/examples/h100.yaml"))
    assert not plan.refusals()

"""Recipes, --set overrides and config.json round trips; bad keys and values are one-line errors naming the key."""

from __future__ import annotations

import json

import pytest

from megatron_tir.train.config import apply_overrides, from_dict, to_dict
from megatron_tir.train.recipes import RECIPES, load_recipe


@pytest.mark.parametrize("name", list(RECIPES))
def test_recipes_round_trip_through_json(name):
    cfg = load_recipe(name)
    assert from_dict(json.loads(json.dumps(to_dict(cfg)))) == cfg
    assert cfg.learner.model == cfg.engine.model == cfg.model


def test_the_32b_recipe_is_the_7b_recipe_but_its_model_and_layout():
    """Both SimpleTIR recipes share every hyper-parameter (docs/recipes.md's table documents the 7B one,
    tests/megatron_tir/train/test_recipe_tables.py checks it); only model and memory layout differ."""
    a, b = to_dict(load_recipe("qwen2.5-7b-simpletir")), to_dict(load_recipe("qwen2.5-32b-simpletir"))
    for d in (a, b):
        del d["model"]
        for k in ("model", "tp", "pp", "sequence_parallel", "recompute_granularity", "recompute_method",
                  "recompute_num_layers"):
            d["learner"].pop(k)
        d["engine"].pop("model")
    assert a == b


def test_launcher_keys_in_any_order():
    cfg = apply_overrides(load_recipe("tiny-cpu"), [
        "engine.kind=sglang", "engine.urls=http://h1:30000,http://h2:30000", "engine.colocated=true",
        "sandbox.address=tcp://host:5555", "learner.tp=2", "learner.pp=1", "rollout.max_turns=10",
        "trainer.loss.clip_high=0.3", "trainer.sampling.sample_prompts=null", "rollout.prompt.mode=chat"])
    assert cfg.engine.kind == "sglang" and cfg.engine.urls == ("http://h1:30000", "http://h2:30000")
    assert cfg.engine.colocated is True and cfg.sandbox.address == "tcp://host:5555" and cfg.learner.tp == 2
    assert cfg.rollout.max_turns == 10 and cfg.trainer.loss.clip_high == 0.3
    assert load_recipe("tiny-cpu").rollout.max_turns == 2  # the recipe is not changed


@pytest.mark.parametrize("item,message", [
    ("trainer.foo=1", "unknown key 'trainer.foo'"),
    ("nope.x=1", "unknown key 'nope.x'"),
    ("trainer.steps=abc", "trainer.steps: 'abc' is not an int"),
    ("trainer.steps=0", "trainer.steps=0: steps must be >= 1"),
    ("trainer.mode=fancy", "trainer.mode=fancy: mode must be one of"),
    ("trainer=3", "trainer is a section"),
    ("trainer.loss.clip_low=2", "trainer.loss.clip_low=2: clip_low must be in (0, 1)"),
    ("engine.colocated=maybe", "engine.colocated: 'maybe' is not a bool"),
    ("rollout.prompt.mode=x", "rollout.prompt.mode: 'x' is not one of plain, chat"),
    ("engine.kind=sglang", "engine.kind=sglang: engine kind 'sglang' needs urls"),
    ("steps", "override 'steps' is not key=value"),
    ("learner.model=x", "learner.model follows the top-level model; set model=x instead"),
    ("rollout.void_turn=continue", "rollout.void_turn is decided by trainer.mode; set trainer.mode instead"),
    ("trainer.ppo.advantage=ppo_gae", "trainer.ppo.advantage=ppo_gae: advantage must be one of grpo, dr_grpo"),
    ("reward.workers=0", "reward.workers=0: reward workers must be >= 1"),
])
def test_bad_overrides_are_one_line_errors_naming_the_key(item, message):
    with pytest.raises(ValueError) as info:
        apply_overrides(load_recipe("tiny-cpu"), [item])
    text = str(info.value)
    assert message in text and "\n" not in text


def test_unknown_recipe():
    with pytest.raises(ValueError, match="unknown recipe 'big'.*tiny-cpu"):
        load_recipe("big")


@pytest.mark.parametrize("mode,void_turn", [("naive", "continue"), ("low_prob_filter", "continue"),
                                            ("high_ratio_filter", "continue"), ("stop_without_filter", "stop"),
                                            ("simpletir", "stop")])
def test_mode_decides_the_void_turn_behaviour(mode, void_turn):
    cfg = apply_overrides(load_recipe("tiny-cpu"), [f"trainer.mode={mode}", "rollout.tools=false"])
    assert cfg.rollout.void_turn == void_turn and cfg.rollout.tools is False


def test_the_reward_checker_is_set_from_the_run_config():
    cfg = apply_overrides(load_recipe("tiny-cpu"), ["reward.workers=3", "reward.timeout_s=2.5"])
    assert (cfg.reward.workers, cfg.reward.timeout_s) == (3, 2.5)
    assert from_dict(json.loads(json.dumps(to_dict(cfg)))).reward == cfg.reward


def test_a_config_json_with_an_unknown_advantage_is_refused():
    data = to_dict(load_recipe("tiny-cpu"))
    data["trainer"]["ppo"]["advantage"] = "ppo_gae"
    with pytest.raises(ValueError, match="trainer.ppo: advantage must be one of grpo, dr_grpo, reinforce_pp"):
        from_dict(data)


def test_trainer_async_is_the_command_line_spelling_of_trainer_asynchrony():
    cfg = apply_overrides(load_recipe("tiny-cpu"), ["trainer.async=off", "trainer.async.correction=mask",
                                                   "trainer.async.cap=3"])
    a = cfg.trainer.asynchrony
    assert (a.mode, a.correction, a.cap) == ("off", "mask", 3.0)
    assert load_recipe("tiny-cpu").trainer.asynchrony.correction == "clamp"  # the default
    for item, message in [("trainer.async=sometimes", "mode must be one of off"),
                          ("trainer.async.correction=truncate", "correction must be one of clamp, mask, off"),
                          ("trainer.async.cap=0.5", "cap must be >= 1")]:
        with pytest.raises(ValueError, match=message):
            apply_overrides(load_recipe("tiny-cpu"), [item])


@pytest.mark.parametrize("mode", ["one_step", "full"])
def test_asynchrony_with_colocated_engines_is_refused_naming_both_keys(mode):
    sglang = ["engine.kind=sglang", "engine.urls=http://h1:30000"]
    for order in ([f"trainer.async={mode}", "engine.colocated=true"], ["engine.colocated=true", f"trainer.async={mode}"]):
        with pytest.raises(ValueError) as info:
            apply_overrides(load_recipe("tiny-cpu"), sglang + order)
        text = str(info.value)
        assert f"trainer.async={mode}" in text and "engine.colocated=true" in text and "\n" not in text
    # either alone is a valid run
    assert apply_overrides(load_recipe("tiny-cpu"), sglang + ["engine.colocated=true"]).engine.colocated
    assert apply_overrides(load_recipe("tiny-cpu"), sglang + ["trainer.async=one_step"]).trainer.asynchrony.mode == "one_step"

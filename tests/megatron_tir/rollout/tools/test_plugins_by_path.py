"""A reward function and a tool named by import path (no package edit) are used in a rollout: the scripted
model calls the lookup tool, reads its fact, answers, and the reward is the test module's function's
(computed in the reward workers); bad paths are one-line errors naming the key."""

from __future__ import annotations

import asyncio

import pytest
from plugins_by_path import Lookup

from megatron_tir.data import Problem
from megatron_tir.reward import MathVerifier, RewardConfig
from megatron_tir.rollout import FinishStatus, RolloutConfig, TIRRollout
from megatron_tir.tir import TurnKind
from megatron_tir.train.config import apply_overrides
from megatron_tir.train.recipes import load_recipe

from scripted_engine import ScriptedEngine

PROBLEM = Problem(index=0, messages=({"role": "user", "content": "What is the answer to everything?"},),
                  ground_truth="42")


def script(context_text: str) -> str:
    if "<fact>" not in context_text:
        return "I will look it up. <lookup>answer to everything</lookup> never sampled"
    return "The fact says \\boxed{42}."


def _rollout(tok, reward_function: str):
    driver_cfg = RolloutConfig(max_response_tokens=256, toolset=("plugins_by_path:Lookup",))
    with MathVerifier(RewardConfig(function=reward_function, workers=1)) as verifier:
        driver = TIRRollout(ScriptedEngine(tok, script), tok, None, driver_cfg, verifier=verifier)
        (group,) = asyncio.run(driver.run([PROBLEM]))
    return group.trajectories[0]


def test_reward_and_tool_by_import_path_are_used_in_a_rollout(smollm2_tokenizer):
    t = _rollout(smollm2_tokenizer, "plugins_by_path:exact_match_reward")
    assert t.status is FinishStatus.COMPLETED and t.final_answer == "42"
    assert [x.kind for x in t.turns] == [TurnKind.CODE, TurnKind.ANSWER]
    call = t.turns[0]
    assert call.text == "I will look it up. <lookup>answer to everything</lookup>"
    assert call.tool.name == "lookup" and call.tool.feedback == "<fact>42</fact>\n"
    assert isinstance(Lookup.made[-1].context.config, RolloutConfig)  # made with the ToolContext
    assert t.reward == 2.0  # the test module's function (math-verify gives 1 or 0)


def test_a_reward_function_that_returns_nan_scores_zero(smollm2_tokenizer):
    assert _rollout(smollm2_tokenizer, "plugins_by_path:not_a_number").reward == 0.0


def test_the_calculator_example_is_a_tool_that_is_not_python(smollm2_tokenizer):
    tok = smollm2_tokenizer
    turns = iter(["Compute <calc>2*(3+4)</calc>", "So \\boxed{14}."])
    cfg = RolloutConfig(max_response_tokens=256, toolset=("examples.plugins.calculator:Calculator",))
    engine = ScriptedEngine(tok, lambda ctx: "So \\boxed{14}." if "<result>" in ctx else next(turns))
    (group,) = asyncio.run(TIRRollout(engine, tok, None, cfg).run([PROBLEM]))
    t = group.trajectories[0]
    assert t.turns[0].tool.name == "calc" and t.turns[0].tool.feedback == "<result>14</result>\n"
    assert t.final_answer == "14" and t.status is FinishStatus.COMPLETED


def test_bad_import_paths_are_one_line_errors_naming_the_key():
    with pytest.raises(ValueError, match=r"^rollout.toolset: cannot import 'no_such_module_x' \(ModuleNotFound"):
        RolloutConfig(toolset=("python", "no_such_module_x:Tool"))
    with pytest.raises(ValueError, match=r"^reward.function: module 'plugins_by_path' has no attribute 'nope'"):
        RewardConfig(function="plugins_by_path:nope")
    with pytest.raises(ValueError, match=r"reward.function: 'score' is not an import path"):
        apply_overrides(load_recipe("tiny-cpu"), ["reward.function=score"])
    with pytest.raises(ValueError, match=r"plugins_by_path:FACTS is not callable"):
        RolloutConfig(toolset=("plugins_by_path:FACTS",))
    cfg = apply_overrides(load_recipe("tiny-cpu"), ["reward.function=plugins_by_path:exact_match_reward",
                                                    "rollout.toolset=python,plugins_by_path:Lookup"])
    assert cfg.rollout.toolset == ("python", "plugins_by_path:Lookup")

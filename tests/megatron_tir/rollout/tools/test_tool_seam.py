"""Tools as a seam: a second tool, written and registered here, runs through the driver.

The toy calculator is recognised by its own tag (``<calc>6*7</calc>``), runs
asynchronously, answers ``<result>42</result>``, reports the model's errors (``1/0``) as
feedback and its own crash as an infrastructure failure. Nothing outside this file knows
it: it is one class and one ``register`` call (here, ``monkeypatch`` so it is removed after).
"""

from __future__ import annotations

import ast
import asyncio
import operator
import re

import pytest

from megatron_tir.data import Problem
from megatron_tir.rollout import FinishStatus, RolloutConfig, TIRRollout, collate
from megatron_tir.rollout.tools import ToolResult, registry
from megatron_tir.rollout.trajectory import INFRA_STATUSES
from megatron_tir.tir import FEEDBACK_HEADER, TurnKind
from megatron_tir.tir.calls import CallText

from scripted_engine import ScriptedEngine

CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg}
PROBLEM = Problem(index=0, messages=({"role": "user", "content": "What is 6 times 7?"},), ground_truth="42")


def _evaluate(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"not arithmetic: {ast.dump(node)[:40]}")


class Calculator:
    name = "calc"

    def __init__(self, *, crash: bool = False) -> None:
        self.crash = crash
        self.calls: list[str] = []

    def stop_strings(self, turn_text: str) -> tuple[str, ...]:
        return ("</calc>",)

    def find_call(self, turn_text: str) -> CallText | None:
        m = CALL.search(turn_text)
        return None if m is None else CallText(payload=m.group(1), end=m.end(), reason="complete calc call")

    async def execute(self, payload: str) -> ToolResult:
        self.calls.append(payload)
        await asyncio.sleep(0.01)  # the engine serves the others meanwhile
        if self.crash:
            raise ConnectionError("calculator service is down")
        try:
            value = _evaluate(ast.parse(payload.strip(), mode="eval").body)
        except (ValueError, SyntaxError, ZeroDivisionError) as exc:
            return ToolResult(status="error", output=f"{type(exc).__name__}: {exc}")
        return ToolResult(status="ok", output=f"{value:g}", record={"expression": payload, "value": value})

    def feedback(self, result, context) -> str:
        return f"<result>{result.output}</result>\n"

    def answer(self, result) -> str | None:
        return None


def per_result(*turns):
    """A script that writes turns[k] after the k-th tool result it reads (either tool's)."""
    def script(context_text):
        k = context_text.count("<result>") + context_text.count(FEEDBACK_HEADER + "\n```output")
        return turns[min(k, len(turns) - 1)]
    return script


def rollout(tok, script, *, sandbox=None, **cfg):
    engine = ScriptedEngine(tok, script)
    driver = TIRRollout(engine, tok, sandbox, RolloutConfig(max_response_tokens=512, **cfg))
    (group,) = asyncio.run(driver.run([PROBLEM]))
    return engine, group.trajectories[0]


@pytest.fixture
def calc(monkeypatch):
    made = []

    def make(context):
        made.append(Calculator(crash=context.config.seed == 13))  # a switch only this test reads
        return made[-1]

    monkeypatch.setitem(registry.TOOLS, "calc", make)
    return made


def test_the_calculator_runs_through_the_driver(smollm2_tokenizer, calc):
    tok = smollm2_tokenizer
    turns = ("Let me compute. <calc>6 * 7</calc> and this is never sampled.", "So it is \\boxed{42}.")
    engine, t = rollout(tok, per_result(*turns), toolset=("calc",))
    assert t.status is FinishStatus.COMPLETED and t.final_answer == "42"
    assert [x.kind for x in t.turns] == [TurnKind.CODE, TurnKind.ANSWER]
    call = t.turns[0]
    assert call.text == "Let me compute. <calc>6 * 7</calc>"  # the engine stopped at the closing tag
    assert call.code == "6 * 7" and call.reason == "complete calc call" and calc[0].calls == ["6 * 7"]
    assert call.tool.name == "calc" and call.tool.status == "ok" and call.tool.result["value"] == 42
    assert call.tool.feedback == "<result>42</result>\n" and not call.tool.infra_failure
    assert "</calc>" in engine.calls[0]["stop"] and "```" not in engine.calls[0]["stop"]  # only its stops
    fb_ids = tok.encode(call.tool.feedback, add_special_tokens=False)
    n = call.start + call.model_tokens
    assert t.response_ids[n:n + len(fb_ids)] == fb_ids and t.loss_mask[n:n + len(fb_ids)] == [0] * len(fb_ids)
    assert t.response_versions[n:n + len(fb_ids)] == [-1] * len(fb_ids)
    t.reward = 1.0
    batch = collate([_group(t)], pad_id=0)
    assert int(batch.loss_mask_BT.sum()) == t.num_model_tokens


def test_the_models_error_is_feedback_and_the_tools_crash_is_infrastructure(smollm2_tokenizer, calc):
    tok = smollm2_tokenizer
    _, t = rollout(tok, per_result("<calc>1 / 0</calc>", "\\boxed{0}"), toolset=("calc",))
    assert t.status is FinishStatus.COMPLETED and t.turns[0].tool.status == "error"
    assert t.turns[0].tool.feedback == "<result>ZeroDivisionError: division by zero</result>\n"
    _, t = rollout(tok, per_result("<calc>6 * 7</calc>", "\\boxed{42}"), toolset=("calc",), seed=13)
    assert t.status is FinishStatus.TOOL_FAILED and t.status in INFRA_STATUSES and len(t.turns) == 1  # counts nowhere
    assert t.turns[0].tool.infra_error == "ConnectionError: calculator service is down"


def test_python_and_the_calculator_together_first_call_wins(smollm2_tokenizer, sandbox, calc):
    tok = smollm2_tokenizer
    turns = ("First python:\n```python\nprint(6 * 7)\n```\nthen <calc>1+1</calc>",
             "Now <calc>40 + 2</calc> and ```python\nprint(0)\n```",
             "Both say \\boxed{42}.")
    engine, t = rollout(tok, per_result(*turns), sandbox=sandbox, toolset=("python", "calc"))
    assert t.status is FinishStatus.COMPLETED and t.final_answer == "42"
    assert [x.tool.name for x in t.turns[:2]] == ["python", "calc"]
    assert t.turns[0].tool.result.stdout == "42\n" and t.turns[0].text.endswith("```")
    assert t.turns[1].text == "Now <calc>40 + 2</calc>" and t.turns[1].tool.feedback == "<result>42</result>\n"
    assert {"```", "</calc>"} <= set(engine.calls[0]["stop"])


def test_the_toolset_is_checked_against_the_registry(calc):
    with pytest.raises(ValueError, match=r"distinct names among \['calc', 'python'\], got \['abacus'\]"):
        RolloutConfig(toolset=("abacus",))
    with pytest.raises(ValueError, match="already registered"):
        registry.register("calc", lambda context: Calculator())
    with pytest.raises(ValueError, match="python tool needs a sandbox"):
        TIRRollout(None, None, None, RolloutConfig())


def _group(t):
    from megatron_tir.rollout import Group

    return Group(group_id=t.group_id, problem=None, trajectories=[t])

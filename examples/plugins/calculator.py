"""A tool that is not Python: the model writes ``<calc>2*(3+4)</calc>`` and reads ``<result>14</result>``.

Use it without editing the package (the repository root on ``PYTHONPATH``)::

    megatron-tir train --recipe smollm2-cpu --set rollout.toolset=python,examples.plugins.calculator:Calculator ...

The registry makes it with ``Calculator(context)`` (a :class:`megatron_tir.rollout.tools.ToolContext`:
the rollout's sandbox, protocol and config). It evaluates arithmetic in-process through Python's
``ast`` (numbers, + - * / ** and unary minus; nothing else is evaluated), so it needs no sandbox;
the model's mistakes (``1/0``, ``x+1``) come back as feedback, as the Python tool's errors do.
Tell the model about the tool in the prompt (``rollout.prompt.instruction``).
"""

from __future__ import annotations

import ast
import operator
import re

from megatron_tir.rollout.tools import ToolResult
from megatron_tir.tir.calls import CallText

CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
             ast.Pow: operator.pow, ast.USub: operator.neg}
MAX_EXPONENT = 1000  # 10**10**10 would hang the rollout's event loop


def evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left, right = evaluate(node.left), evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is too large")
        return OPERATORS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](evaluate(node.operand))
    raise ValueError("only numbers and + - * / ** are allowed")


class Calculator:
    name = "calc"

    def __init__(self, context=None) -> None:
        self.context = context

    def stop_strings(self, turn_text: str) -> tuple[str, ...]:
        return ("</calc>",)  # generation pauses where a call ends

    def find_call(self, turn_text: str) -> CallText | None:
        m = CALL.search(turn_text)
        return None if m is None else CallText(payload=m.group(1), end=m.end(), reason="complete calc call")

    async def execute(self, payload: str) -> ToolResult:
        try:
            value = evaluate(ast.parse(payload.strip(), mode="eval").body)
        except (ValueError, SyntaxError, ZeroDivisionError, OverflowError) as exc:
            return ToolResult(status="error", output=f"{type(exc).__name__}: {exc}")
        return ToolResult(status="ok", output=f"{value:g}", record={"expression": payload, "value": value})

    def feedback(self, result: ToolResult, context) -> str:
        return f"<result>{result.output}</result>\n"  # loss mask 0: the model does not learn to write it

    def answer(self, result: ToolResult) -> str | None:
        return None  # a calculation is not a final answer

"""A reward function and a tool that the tests name by import path (``plugins_by_path:...``), as a
user's own module would be: nothing in megatron_tir knows them."""

from __future__ import annotations

import re

from megatron_tir.rollout.tools import ToolResult
from megatron_tir.tir.calls import CallText

FACTS = {"answer to everything": "42", "capital of france": "Paris"}
CALL = re.compile(r"<lookup>(.*?)</lookup>", re.DOTALL)


def exact_match_reward(answer: str | None, ground_truth: str) -> float:
    """2 for the exact string, -1 otherwise (math-verify could never give either)."""
    return 2.0 if answer is not None and answer.strip() == ground_truth else -1.0


def not_a_number(answer, ground_truth):
    return float("nan")


class Lookup:
    """A lookup tool (a stand-in for a search service): ``<lookup>key</lookup>`` -> ``<fact>value</fact>``."""

    name = "lookup"
    made: list = []

    def __init__(self, context) -> None:
        self.context = context
        Lookup.made.append(self)

    def stop_strings(self, turn_text: str) -> tuple[str, ...]:
        return ("</lookup>",)

    def find_call(self, turn_text: str) -> CallText | None:
        m = CALL.search(turn_text)
        return None if m is None else CallText(payload=m.group(1), end=m.end(), reason="complete lookup call")

    async def execute(self, payload: str) -> ToolResult:
        key = payload.strip().lower()
        if key not in FACTS:
            return ToolResult(status="not_found", output=f"no fact for {key!r}")
        return ToolResult(status="ok", output=FACTS[key])

    def feedback(self, result: ToolResult, context) -> str:
        return f"<fact>{result.output}</fact>\n"

    def answer(self, result: ToolResult) -> str | None:
        return None

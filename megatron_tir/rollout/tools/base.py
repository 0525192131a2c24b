"""What a tool is, rollout side: its call syntax, its asynchronous execution, its feedback.

A :class:`Tool` answers four questions for the driver:

* how its call is recognised in model text (``stop_strings`` / ``find_call``, the
  :class:`~megatron_tir.tir.calls.CallSyntax` the protocol presets read turns through);
* how the call runs (``await execute(payload)``: many in flight; the model's errors are
  results, never exceptions);
* what feedback text the model reads back (``feedback``) and whether the output names a
  final answer (``answer``);
* whose failure a failed call is (:attr:`ToolResult.infra_error`): the model's (bad code,
  a timeout: feedback, the trajectory goes on) or the infrastructure's (the trajectory
  ends ``tool_failed`` and no policy update uses it).

Tools are made per rollout by :func:`megatron_tir.rollout.tools.registry.build_tools`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from megatron_tir.tir.calls import CallText


@dataclass(kw_only=True, slots=True)
class ToolResult:
    status: str  # the tool's own outcome name ("ok", "error", "timeout", ...)
    output: str = ""  # what the call printed or returned (final answers are read from it)
    infra_error: str | None = None  # the infrastructure failed (not the model's doing): why
    record: Any = None  # the tool's own record of the call (msgspec/dataclass; JSON via msgspec.to_builtins)

    @property
    def infra_failure(self) -> bool:
        return self.infra_error is not None


@dataclass(kw_only=True, slots=True, frozen=True)
class FeedbackContext:
    turn_index: int
    max_turns: int
    turn_text: str  # the model's text of the turn the call ended


class Tool(Protocol):
    name: str

    def stop_strings(self, turn_text: str) -> tuple[str, ...]: ...

    def find_call(self, turn_text: str) -> CallText | None: ...

    async def execute(self, payload: str) -> ToolResult:
        """Run one call. The model's errors are results; an exception means the infrastructure failed."""
        ...

    def feedback(self, result: ToolResult, context: FeedbackContext) -> str:
        """The text appended after the call ("" appends nothing); never called for infrastructure failures."""
        ...

    def answer(self, result: ToolResult) -> str | None:
        """The final answer the call's output names, if any (it can end the trajectory)."""
        ...

"""The Python tool: code blocks run in the sandbox cluster.

Its call syntax, the program it runs (the ``final_answer`` prelude + the block), its
feedback and the answers it reads are the protocol preset's (:mod:`megatron_tir.tir`);
execution is the sandbox's. The sandbox's ``sandbox_error`` and ``overloaded`` (and an
exception from its client) are the infrastructure's failures; every other status (ok,
error, timeout, memory, output limit) is the outcome of the model's code.
"""

from __future__ import annotations

import logging

from megatron_tir.rollout.sandbox import Sandbox
from megatron_tir.rollout.tools.base import FeedbackContext, ToolResult
from megatron_tir.tir.calls import PYTHON, CallText
from megatron_tir.tir.protocol import TIRProtocol
from sandbox_cluster.protocol import ExecResult, Status

log = logging.getLogger(__name__)

INFRA_FAILURES = frozenset({Status.SANDBOX_ERROR, Status.OVERLOADED})


class PythonTool:
    name = PYTHON

    def __init__(self, *, sandbox: Sandbox, protocol: TIRProtocol, timeout_s: float, memory_mb: int) -> None:
        self.sandbox = sandbox
        self.protocol = protocol
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb

    def stop_strings(self, turn_text: str) -> tuple[str, ...]:
        return self.protocol.code_stop_strings(turn_text)

    def find_call(self, turn_text: str) -> CallText | None:
        return self.protocol.code_call(turn_text)

    async def execute(self, payload: str) -> ToolResult:
        try:
            res = await self.sandbox.execute(self.protocol.program(payload), timeout=self.timeout_s,
                                             memory_mb=self.memory_mb)
        except Exception as exc:  # noqa: BLE001 - a sandbox failure is a recorded outcome
            log.warning("sandbox call failed: %s: %s", type(exc).__name__, exc)
            res = ExecResult(id="", status=Status.SANDBOX_ERROR, message=f"{type(exc).__name__}: {exc}")
        infra = None
        if res.status in INFRA_FAILURES:
            infra = f"{res.status.value}: {res.message}".rstrip(": ")
            log.warning("sandbox infrastructure failure (%s): %s", res.status.value, res.message)
        return ToolResult(status=res.status.value, output=res.stdout, infra_error=infra, record=res)

    def feedback(self, result: ToolResult, context: FeedbackContext) -> str:
        return self.protocol.feedback(result.record, turn_index=context.turn_index, max_turns=context.max_turns,
                                      turn_text=context.turn_text, timeout=self.timeout_s, memory_mb=self.memory_mb)

    def answer(self, result: ToolResult) -> str | None:
        return self.protocol.tool_answer(result.output)

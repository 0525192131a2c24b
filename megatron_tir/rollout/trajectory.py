"""The record that crosses the rollout/training boundary: one multi-turn trajectory.

Token-level arrays are aligned with ``response_ids``: position ``i`` is response token
``i``; ``loss_mask[i]`` is 1 for a token the policy sampled and 0 for a feedback token
(tool output) the driver appended; ``response_logprobs[i]`` is the engine's log-prob of
a sampled token and NaN for a feedback token; ``response_versions[i]`` is the weight
version of the engine that sampled token ``i`` (``Generation.versions``) and -1 for a
feedback token. The ids are exactly what the engine returned: nothing is decoded and
re-tokenized.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import msgspec

from typing import Any

from megatron_tir.rollout.engines.base import FinishReason
from megatron_tir.tir.calls import PYTHON
from megatron_tir.tir.markup import TurnKind


class FinishStatus(str, enum.Enum):
    """How a trajectory ended (slime-style)."""

    COMPLETED = "completed"  # a final answer: an answer turn, or final_answer() output
    TRUNCATED = "truncated"  # the response-token budget ran out (not inside a void turn)
    MAX_TURNS = "max_turns"  # the turn budget ran out after a code turn
    VOID = "void"  # ended on a void turn (SimpleTIR); which modes train it: megatron_tir.rl.rows
    TOOL_FAILED = "tool_failed"  # the sandbox infrastructure failed (not the model's code)
    ABORTED = "aborted"  # the engine aborted a request (pause, shutdown, server error)
    PROMPT_TOO_LONG = "prompt_too_long"  # a data error: the engine refused the prompt as longer than its context


# Ended by the infrastructure, not the model: such rows count nowhere in an update (megatron_tir.rl.rows)
# and an eval or a run with too many of them stops instead of reporting on the model.
INFRA_STATUSES = frozenset({FinishStatus.TOOL_FAILED, FinishStatus.ABORTED})


@dataclass(kw_only=True, slots=True)
class ToolCall:
    """One call of a tool in a model turn and what the model was told.

    ``result`` is the tool's own record (the Python tool: the sandbox's ``ExecResult``; a
    sandbox client that raised is recorded with status ``sandbox_error`` and the exception
    in ``message``); ``infra_error`` says why the infrastructure failed, when it did.
    """

    result: Any
    name: str = PYTHON  # the tool (megatron_tir.rollout.tools.registry)
    status: str = ""  # the tool's outcome name ("ok", "error", "timeout", ...)
    infra_error: str | None = None
    latency_s: float = 0.0  # time the trajectory waited for the result
    feedback: str = ""  # the text appended to the trajectory ("" if none was appended)
    answer: str | None = None  # the final answer the tool printed (final_answer), if any

    def __post_init__(self) -> None:
        if not self.status:  # the record's own status, when it has one (the sandbox's ExecResult does)
            status = getattr(self.result, "status", "")
            self.status = str(getattr(status, "value", status))

    @property
    def infra_failure(self) -> bool:
        """The tool's infrastructure failed: not an outcome of the model's call."""
        return self.infra_error is not None


@dataclass(kw_only=True, slots=True)
class Turn:
    index: int
    kind: TurnKind
    reason: str  # why the turn has its kind (see megatron_tir.tir.classify_turn)
    finish_reason: FinishReason  # how the engine ended the turn's last request
    start: int  # offset in response_ids of the turn's first model token
    model_tokens: int
    feedback_tokens: int = 0  # appended after the turn (mask 0)
    text: str = ""  # the model's text of the turn
    code: str | None = None
    answer: str | None = None  # last \boxed{} in the turn's prose
    tool: ToolCall | None = None
    requests: int = 0  # engine requests the turn took (phases)
    discarded_tokens: int = 0  # sampled past the closing fence and dropped (0 unless an engine missed a stop)
    generation_s: float = 0.0

    def __post_init__(self) -> None:
        if self.kind is TurnKind.CODE and self.code is None:
            raise ValueError("a code turn needs its code")
        if self.start < 0 or self.model_tokens < 0 or self.feedback_tokens < 0:
            raise ValueError("turn offsets and token counts must be >= 0")


@dataclass(kw_only=True, slots=True)
class Timings:
    wall_s: float = 0.0  # first engine request -> reward done
    generation_s: float = 0.0  # awaiting the engine
    tool_s: float = 0.0  # awaiting the sandbox
    reward_s: float = 0.0
    queued_s: float = 0.0  # waiting for an in-flight slot before starting


@dataclass(kw_only=True, slots=True)
class Trajectory:
    group_id: int  # one group per prompt (GRPO): n samples share it
    sample_index: int  # 0..n-1 within the group
    problem_index: int = -1  # row of the problem in its dataset
    data_source: str = ""
    ground_truth: str = ""
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)  # NaN for feedback tokens
    loss_mask: list[int] = field(default_factory=list)  # 1 sampled, 0 feedback
    response_versions: list[int] = field(default_factory=list)  # weight version that sampled the token; -1 feedback
    turns: list[Turn] = field(default_factory=list)
    status: FinishStatus | None = None
    void_reason: str | None = None
    final_answer: str | None = None
    answer_source: str | None = None  # "model" (a \boxed{} in model text) or "tool" (final_answer output)
    reward: float | None = None
    reward_failed: bool = False  # the answer check failed (time-out, crashed worker, error): Verdict.failed
    engine_requests: int = 0
    timings: Timings = field(default_factory=Timings)
    # rollout.routed_experts: the engine's MoE routing, [n, layers x k] int16 expert ids of positions 0 .. n - 1
    # of prompt_ids + response_ids (megatron_tir.rollout.routing_trace); None otherwise
    routed_experts: Any = None

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("a trajectory needs prompt ids")
        if self.group_id < 0 or self.sample_index < 0:
            raise ValueError("group_id and sample_index must be >= 0")

    # -- appending (used by the driver; keeps the three arrays aligned)

    def append_model_tokens(self, ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        assert len(ids) == len(logprobs) == len(versions), "one log-prob and one weight version per sampled token"
        self.response_ids.extend(ids)
        self.response_logprobs.extend(float(x) for x in logprobs)
        self.loss_mask.extend([1] * len(ids))
        self.response_versions.extend(int(v) for v in versions)

    def append_feedback_tokens(self, ids: list[int]) -> None:
        self.response_ids.extend(ids)
        self.response_logprobs.extend([math.nan] * len(ids))
        self.loss_mask.extend([0] * len(ids))
        self.response_versions.extend([-1] * len(ids))

    # -- views

    @property
    def void(self) -> bool:
        return self.status is FinishStatus.VOID

    @property
    def has_void_turn(self) -> bool:
        """A turn of this trajectory was void (with ``void_turn="continue"`` the trajectory went on)."""
        return any(t.kind is TurnKind.VOID for t in self.turns)

    @property
    def num_model_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def num_feedback_tokens(self) -> int:
        return len(self.loss_mask) - sum(self.loss_mask)

    @property
    def correct(self) -> bool:
        return self.reward is not None and self.reward > 0

    def to_json(self, *, include_ids: bool = False) -> dict:
        """A JSON-ready dict (ids only on request; NaN log-probs become null)."""
        out = {
            "group_id": self.group_id,
            "sample_index": self.sample_index,
            "problem_index": self.problem_index,
            "data_source": self.data_source,
            "ground_truth": self.ground_truth,
            "status": None if self.status is None else self.status.value,
            "void": self.void,
            "has_void_turn": self.has_void_turn,
            "void_reason": self.void_reason,
            "final_answer": self.final_answer,
            "answer_source": self.answer_source,
            "reward": self.reward,
            "prompt_tokens": len(self.prompt_ids),
            "model_tokens": self.num_model_tokens,
            "feedback_tokens": self.num_feedback_tokens,
            "engine_requests": self.engine_requests,
            "timings": {k: getattr(self.timings, k) for k in Timings.__slots__},
            "turns": [_turn_json(t) for t in self.turns],
        }
        if include_ids:
            out["prompt_ids"] = list(self.prompt_ids)
            out["response_ids"] = list(self.response_ids)
            out["loss_mask"] = list(self.loss_mask)
            out["response_logprobs"] = [None if math.isnan(x) else x for x in self.response_logprobs]
            out["response_versions"] = list(self.response_versions)
        return out


def _turn_json(t: Turn) -> dict:
    d = {k: getattr(t, k) for k in Turn.__slots__ if k != "tool"}
    d["kind"] = t.kind.value
    d["finish_reason"] = t.finish_reason.value
    if t.tool is None:
        d["tool"] = None
    else:
        d["tool"] = {k: getattr(t.tool, k) for k in ToolCall.__slots__ if k != "result"}
        d["tool"]["result"] = msgspec.to_builtins(t.tool.result)
    return d

"""Crafted trajectories with turns, code and tool results (no model) for the observe tests."""

from __future__ import annotations

from megatron_tir.rollout.engines.base import FinishReason
from megatron_tir.rollout.trajectory import FinishStatus, ToolCall, Trajectory, Turn
from megatron_tir.tir.markup import TurnKind
from sandbox_cluster.protocol import ExecResult, Status


def code_turn(index: int, code: str, *, stdout: str = "", stderr: str = "", status: Status = Status.OK,
              prose: str = "", answer: str | None = None) -> dict:
    return {"index": index, "kind": TurnKind.CODE, "text": f"{prose}```python\n{code}\n```", "code": code,
            "tool": ToolCall(result=ExecResult(id=f"t{index}", status=status, stdout=stdout, stderr=stderr),
                             status=status.value, feedback=f"Code Execution Result: {stdout}{stderr}\n", answer=answer,
                             infra_error=status.value if status in (Status.SANDBOX_ERROR, Status.OVERLOADED) else None)}


def answer_turn(index: int, text: str, answer: str) -> dict:
    return {"index": index, "kind": TurnKind.ANSWER, "text": text, "answer": answer}


def void_turn(index: int, text: str, finish=FinishReason.LENGTH) -> dict:
    return {"index": index, "kind": TurnKind.VOID, "text": text, "finish_reason": finish}


def make(turns: list[dict], *, status=FinishStatus.COMPLETED, reward: float = 1.0, final_answer: str | None = None,
         group: int = 0, sample: int = 0, logprobs_per_turn: list[list[float]] | None = None,
         feedback_tokens: int = 2, void_reason: str | None = None) -> Trajectory:
    """A trajectory whose turn k has the log-probs ``logprobs_per_turn[k]`` (default: 3 tokens of -0.5)
    and ``feedback_tokens`` feedback tokens after each code turn."""
    t = Trajectory(group_id=group, sample_index=sample, prompt_ids=[1, 2, 3], ground_truth=final_answer or "")
    for k, spec in enumerate(turns):
        lps = logprobs_per_turn[k] if logprobs_per_turn else [-0.5, -0.5, -0.5]
        start = len(t.response_ids)
        t.append_model_tokens([100 + k] * len(lps), lps, [0] * len(lps))
        fb = feedback_tokens if spec.get("tool") is not None else 0
        if fb:
            t.append_feedback_tokens([7] * fb)
        t.turns.append(Turn(index=spec["index"], kind=spec["kind"], reason=spec.get("reason", "crafted"),
                            finish_reason=spec.get("finish_reason", FinishReason.STOP), start=start,
                            model_tokens=len(lps), feedback_tokens=fb, text=spec["text"], code=spec.get("code"),
                            answer=spec.get("answer"), tool=spec.get("tool")))
    t.status, t.reward, t.final_answer, t.void_reason = status, reward, final_answer, void_reason
    return t

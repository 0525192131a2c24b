"""The generation-engine interface shared by the local (torch) engine and SGLang.

Token ids in; sampled token ids, their log-probs and the finish reason out. Nothing is
decoded and re-tokenized: the ids returned are exactly the ids that were sampled, so the
trainer trains exactly what the engine generated.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


@dataclass(kw_only=True, slots=True, frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    stop: tuple[str, ...] = ()  # matched in generated text only; kept in the output
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")


class FinishReason(str, enum.Enum):
    STOP = "stop"  # a stop string matched (see Generation.matched_stop)
    EOS = "eos"  # the model emitted an end-of-sequence token
    LENGTH = "length"  # max_new_tokens reached
    ABORT = "abort"  # the engine aborted the request (pause, shutdown, server error)


@dataclass(kw_only=True, slots=True)
class Generation:
    token_ids: list[int]
    # One per token: log_softmax(logits / T)[token] -- temperature applied, top-k / top-p
    # truncation not (SGLang's default); greedy (T = 0) reports T = 1. See sampling.py.
    logprobs: list[float]
    finish_reason: FinishReason
    matched_stop: str | None = None
    prompt_tokens: int = 0
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert len(self.token_ids) == len(self.logprobs), "one log-prob per sampled token"


@runtime_checkable
class GenerationEngine(Protocol):
    """Async generation over token ids; safe to call with many requests in flight."""

    eos_token_ids: tuple[int, ...]

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation: ...

    async def update_weights(self, named_tensors: Iterable[tuple[str, "torch.Tensor"]]) -> None:
        """Load new policy weights (HF parameter names) for the next requests."""
        ...

    async def pause(self) -> None:
        """Stop admitting requests (in-flight ones finish or are aborted).

        LocalEngine: in-flight requests are held (``abort_in_flight=True`` aborts them);
        SGLangEngine: ``mode="abort"`` (default), ``"retract"`` or ``"in_place"``.
        """
        ...

    async def resume(self) -> None: ...

    async def close(self) -> None: ...

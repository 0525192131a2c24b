"""The generation-engine interface shared by the local (torch) engine and SGLang.

Token ids in; sampled token ids, their log-probs, the weight version that sampled each
of them and the finish reason out. Nothing is decoded and re-tokenized: the ids returned
are exactly the ids that were sampled, so the trainer trains exactly what the engine
generated.

The interface is what the rollout driver uses. How new weights reach an engine, and the
pause around it, belong to the engine's weight sync (:mod:`megatron_tir.rollout.sync`),
the one caller of an engine's ``pause`` / ``resume``.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from megatron_tir.rollout.factory import EngineConfig
    from megatron_tir.rollout.sync.base import EngineWeightSync, WeightSync


@dataclass(kw_only=True, slots=True, frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    stop: tuple[str, ...] = ()  # matched in generated text only; kept in the output
    seed: int | None = None
    # Routing hint: requests with the same key go to the same server while it is up, so its
    # prefix cache holds their shared prefix (e.g. one trajectory's turns). Engines with one
    # backend ignore it.
    route_key: str | None = None
    # MoE: ask for the routed experts of the sequence's positions from this one on (engines that can:
    # EngineKind.routed_experts; Generation.routed_experts); None: not asked
    routed_experts_from: int | None = None

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
        if self.route_key is not None and not isinstance(self.route_key, str):
            raise ValueError(f"route_key must be a string or None, got {type(self.route_key).__name__}")
        if self.routed_experts_from is not None and self.routed_experts_from < 0:
            raise ValueError(f"routed_experts_from must be >= 0, got {self.routed_experts_from}")


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
    versions: list[int] = field(default_factory=list)  # one per token: the weight version that sampled it
    # asked for (SamplingParams.routed_experts_from = s): ``[n, layers x k]`` int32 logical expert ids of
    # positions s .. s + n - 1 of prompt + output (the last output token was never forwarded: n = prompt +
    # output - 1 - s); None when not asked, or the request was aborted before the server reported them
    routed_experts: Any = None

    def __post_init__(self) -> None:
        assert len(self.token_ids) == len(self.logprobs), "one log-prob per sampled token"
        assert len(self.versions) == len(self.token_ids), "one weight version per sampled token"


class PauseMode(str, enum.Enum):
    """What an engine's ``pause`` does with requests in flight (SGLang's three modes)."""

    ABORT = "abort"  # they finish now: ABORT with what they have generated so far
    RETRACT = "retract"  # they wait; their KV cache is dropped and recomputed (new weights) on resume
    IN_PLACE = "in_place"  # they wait with their KV cache and continue on resume


DEFAULT_PAUSE_MODE = PauseMode.ABORT


def pause_mode(mode: PauseMode | str) -> PauseMode:
    """``mode`` as a PauseMode; ValueError naming the allowed values otherwise."""
    try:
        return PauseMode(mode)
    except ValueError:
        raise ValueError(f"pause mode must be one of {[m.value for m in PauseMode]}, got {mode!r}") from None


# GPU memory an engine frees while the trainer trains (sglang 0.5.23 srt/constants.py GPU_MEMORY_ALL_TYPES).
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


def check_release(released: tuple[str, ...], tags: Sequence[str] | None, *, paused: bool) -> tuple[str, ...]:
    """The tags released after releasing ``tags`` (None: all); ValueError / RuntimeError for a
    release SGLang refuses (it asserts an idle, paused scheduler; a tag is released once)."""
    tags = tuple(MEMORY_TAGS if tags is None else tags)
    unknown = sorted(set(tags) - set(MEMORY_TAGS))
    if unknown or not tags:
        raise ValueError(f"memory tags must be a non-empty subset of {MEMORY_TAGS}, got {list(tags)}")
    if not paused:
        raise RuntimeError("release_memory_occupation needs pause() first: SGLang releases only when idle")
    again = sorted(set(tags) & set(released))
    if again:
        raise ValueError(f"memory tags {again} are already released")
    return tuple(dict.fromkeys(released + tags))


def check_resume(released: tuple[str, ...], tags: Sequence[str] | None) -> tuple[str, ...]:
    """The tags still released after resuming ``tags`` (None: all released); ValueError for a
    tag not released (SGLang's scheduler dies on it: ``offload_tags.remove``)."""
    tags = released if tags is None else tuple(tags)
    not_released = sorted(set(tags) - set(released))
    if not_released:
        raise ValueError(f"memory tags {not_released} were not released (released: {list(released)})")
    return tuple(t for t in released if t not in tags)


class ContextTooLong(ValueError):
    """The engine refused a request whose prompt does not fit its context (SGLang's 400 "... longer than the
    model's context length ..."; the local engine's ``max_seq_len``): the data's doing, not the infrastructure's."""


def check_generate_args(prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
    """The checks every engine makes on a ``generate`` call; returns the prompt as a list of ints."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
    if isinstance(prompt_ids, (str, bytes)):
        raise ValueError("prompt_ids must be token ids, not text")
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("prompt_ids is empty")
    if min(prompt) < 0:
        raise ValueError(f"prompt_ids has negative ids, outside the vocabulary: {[t for t in prompt if t < 0][:5]}")
    return prompt


def bind_event_loop(bound: asyncio.AbstractEventLoop | None, owner: str) -> asyncio.AbstractEventLoop:
    """The running loop, which must be ``bound`` when an engine is already bound to one."""
    loop = asyncio.get_running_loop()
    if bound is not None and bound is not loop:
        raise RuntimeError(f"{owner} is bound to the event loop that first used it; create one per loop")
    return loop


class GenerationEngine(Protocol):
    """Async generation over token ids; safe to call with many requests in flight.

    Implementations match these signatures exactly (a test compares them).
    """

    eos_token_ids: tuple[int, ...]

    @property
    def weight_version(self) -> int:
        """The version of the weights now served: 0 at start, one more after every weight sync."""
        ...

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation: ...

    async def close(self) -> None: ...


# ----------------------------------------------------------------------------- engine kinds


@dataclass(kw_only=True, slots=True, frozen=True)
class ServerPlan:
    """The generation servers one node of a launch runs: the launcher renders each as an agent
    service (``megatron_tir.launch``); the kind says what each one's command is."""
    model_path: str
    host: str
    first_port: int  # server i listens on first_port + i
    count: int
    tp: int  # GPUs per server (server i on GPUs i*tp .. i*tp + tp - 1 of those it sees)
    mem_fraction_static: float
    colocated: bool
    python: str  # the interpreter that runs a server's module
    extra_args: tuple[str, ...] = ()
    ep: int = 1  # MoE: expert-parallel size inside each server (divides tp)
    routed_experts: bool = False  # MoE: the servers capture each token's routed experts for the rollouts


@dataclass(kw_only=True, slots=True, frozen=True)
class EngineKind:
    """One engine kind, as :data:`megatron_tir.rollout.factory.ENGINE_KINDS` holds it by name: a new
    kind is its own files (the engine, its syncs, one of these) plus one line there.

    * ``check(cfg)``: the kind's rules on an :class:`~megatron_tir.rollout.factory.EngineConfig`
      (ValueError, one line; run by its ``__post_init__``); ``where(cfg)``: the engine as the
      start-up check names it.
    * ``settings(cfg, model_dir)``: the engine's own typed config (its bounds checked there, before
      anything loads); ``build(cfg, settings, model_dir)``: ``(engine, tokenizer)``.
    * ``engine_sync(cfg, engine, pause_mode)``: on the rank holding the engine, its
      :class:`~megatron_tir.rollout.sync.base.EngineWeightSync` (also its ``offload`` before
      training), or None when the kind's weights go from every rank instead.
    * ``weight_sync(cfg, service, pause_mode)``: the trainer's
      :class:`~megatron_tir.rollout.sync.base.WeightSync`, built and started on every rank at
      once; ``service`` is rank 0's rollout service (``engine``, ``submit``, ``sync_from``) and
      None elsewhere.
    * ``servers(plan)``: ``(service name, argv)`` per server a launch starts for the kind
      (:class:`ServerPlan`); None: the engine runs inside the trainer.
    * ``before_wait()``: what a trainer thread does before it waits for the engine's work (the
      local engine, which computes in this process: its idle OpenMP team is handed back,
      :mod:`megatron_tir.rollout.engines.openmp`); None: nothing.
    """
    check: Callable[[EngineConfig], None]
    where: Callable[[EngineConfig], str]
    settings: Callable[[EngineConfig, Path], Any]
    build: Callable[[EngineConfig, Any, Path], tuple[GenerationEngine, Any]]
    engine_sync: Callable[[EngineConfig, GenerationEngine, PauseMode], EngineWeightSync | None]
    weight_sync: Callable[[EngineConfig, Any, PauseMode], WeightSync]
    servers: Callable[[ServerPlan], list[tuple[str, list[str]]]] | None = None
    routed_experts: bool = False  # its engine answers SamplingParams.routed_experts_from (MoE routing replay)
    before_wait: Callable[[], Any] | None = None

"""STAND-IN (trainer branch) for the protocol helper's factory: the two typed configs of the
team contract, so the trainer's config can be built and tested before the ``protocol``
branch is merged. The merge replaces this file with the real one."""

from __future__ import annotations

from dataclasses import dataclass

ENGINE_KINDS = ("local", "sglang")


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    kind: str = "local"
    model: str = "smollm2"
    urls: tuple[str, ...] = ()
    colocated: bool = False
    max_batch_size: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ENGINE_KINDS:
            raise ValueError(f"engine kind must be one of {', '.join(ENGINE_KINDS)}, got {self.kind!r}")
        if self.kind == "sglang" and not self.urls:
            raise ValueError("engine kind 'sglang' needs urls")


@dataclass(kw_only=True, slots=True)
class SandboxConfig:
    address: str | None = None
    workers: int = 2

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"sandbox workers must be >= 1, got {self.workers}")

"""The one place that builds a rollout's generation engine and sandbox (eval and trainer).

* :data:`ENGINE_KINDS` is the registry of engine kinds (``local``: the in-process torch
  engine; ``sglang``: HTTP client of SGLang servers): per kind an
  :class:`~megatron_tir.rollout.engines.base.EngineKind` with its config rules, engine builder,
  weight syncs and launch services, defined in the kind's own files. Nothing outside them
  compares kind names: a new kind is its files plus one line here (docs/engines.md).
* :class:`EngineConfig` says which engine and for which model;
  :func:`engine_settings` turns it into the engine's own typed config, whose
  ``__post_init__`` holds the bounds (so they are checked once, there, before anything
  loads); :func:`build_engine` loads it and returns ``(engine, tokenizer)``;
  :func:`build_engine_sync` (rank 0) and :func:`build_weight_sync` (every trainer rank) give
  its weight syncs.
* :class:`SandboxConfig` says where the sandbox broker is (``None``: start a
  :class:`~sandbox_cluster.LocalCluster` with ``workers`` workers, whose constructor
  checks its bounds); :func:`open_sandbox` is a context manager yielding a
  :class:`~megatron_tir.rollout.sandbox.ClusterSandbox`.
* :func:`probe_engine` and :func:`probe_sandbox` send one tiny request each and raise
  :class:`InfrastructureError` (one line, saying what did not answer) when it fails, so
  a run does not start against an engine or a sandbox that is not there;
  :func:`check_sandbox` / :func:`check_engine` are those checks as eval and the trainer run
  them (naming where they looked).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from megatron_tir.rollout.engines.base import EngineKind, FinishReason, GenerationEngine, PauseMode, SamplingParams
from megatron_tir.rollout.engines.local_kind import LOCAL
from megatron_tir.rollout.engines.sglang.kind import SGLANG
from megatron_tir.rollout.sandbox import ClusterSandbox, Sandbox
from megatron_tir.rollout.sync.base import EngineWeightSync, WeightSync
from sandbox_cluster.protocol import Status

log = logging.getLogger(__name__)

ENGINE_KINDS: dict[str, EngineKind] = {
    "local": LOCAL,
    "sglang": SGLANG,
}


def engine_kind(name: str) -> EngineKind:
    """The registered kind ``name`` (ValueError naming the known ones)."""
    try:
        return ENGINE_KINDS[name]
    except KeyError:
        raise ValueError(f"engine kind must be one of {', '.join(ENGINE_KINDS)}, got {name!r}") from None


class InfrastructureError(RuntimeError):
    """An engine or a sandbox did not answer: not the user's input, not the model's doing."""


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    kind: str = "local"  # "local" (in-process torch engine, CPU default) | "sglang" (HTTP servers)
    model: str = "smollm2"  # "smollm2", "tiny-qwen2" or an HF model directory (SGLang: its tokenizer)
    urls: tuple[str, ...] = ()  # sglang: server (or router) URLs
    colocated: bool = False  # sglang: servers share the trainer's GPUs (the trainer's weight sync reads it)
    max_batch_size: int = 8  # local: requests decoded together
    seed: int = 0  # local: seeds requests that carry no seed of their own

    def __post_init__(self) -> None:
        kind = engine_kind(self.kind)
        self.urls = tuple(self.urls)
        kind.check(self)


@dataclass(kw_only=True, slots=True)
class SandboxConfig:
    address: str | None = None  # broker address (tcp://host:5555, ipc://...); None: start a LocalCluster
    workers: int = 2  # workers of the LocalCluster started when address is None
    probe_timeout_s: float = 60.0  # the start-up probe's wait (a fresh cluster warms its workers first)

    def __post_init__(self) -> None:
        if self.address is not None and not self.address.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"sandbox address must be tcp://, ipc:// or inproc://, got {self.address!r}")
        if not self.probe_timeout_s > 0:
            raise ValueError(f"sandbox probe_timeout_s must be > 0, got {self.probe_timeout_s}")
        if self.address is None and self.workers < 1:
            raise ValueError(f"sandbox workers must be >= 1 for the local cluster, got {self.workers}")


def resolve_model_dir(cfg: EngineConfig) -> Path:
    """The HF directory of ``cfg.model`` (ValueError naming the model when there is none)."""
    from megatron_tir.model_sources import resolve_model

    return resolve_model(cfg.model)


def engine_settings(cfg: EngineConfig, model_dir: Path):
    """The engine's own config for ``cfg`` (checks its bounds; loads nothing but the tokenizer for SGLang)."""
    return engine_kind(cfg.kind).settings(cfg, model_dir)


def build_engine(cfg: EngineConfig, *, model_dir: Path | None = None, settings=None) -> tuple[GenerationEngine, object]:
    """Start the engine of ``cfg``; returns ``(engine, tokenizer)``.

    ``model_dir`` defaults to :func:`resolve_model_dir`; ``settings`` (from
    :func:`engine_settings`) lets a caller check the configuration before starting.
    """
    model_dir = resolve_model_dir(cfg) if model_dir is None else Path(model_dir)
    settings = engine_settings(cfg, model_dir) if settings is None else settings
    return engine_kind(cfg.kind).build(cfg, settings, model_dir)


def build_engine_sync(cfg: EngineConfig, engine: GenerationEngine, *,
                      pause_mode: PauseMode = PauseMode.ABORT) -> EngineWeightSync | None:
    """On the rank holding ``engine`` (built by :func:`build_engine` from ``cfg``): its weight sync
    (``await sync.start()`` before the first ``update``, on the engine's event loop; ``offload``
    before training), or None where the kind's weights go from every rank (:func:`build_weight_sync`
    alone). ``pause_mode``: what a sync does with requests in flight (``retract``: they wait and
    continue under the new weights, ``trainer.async=full``)."""
    return engine_kind(cfg.kind).engine_sync(cfg, engine, pause_mode)


def build_weight_sync(cfg: EngineConfig, service, *, pause_mode: PauseMode = PauseMode.ABORT) -> WeightSync:
    """The trainer's weight sync for ``cfg``'s engine, built and started on every rank at once
    (``update(source)`` on every rank); ``service``: rank 0's rollout service (its ``engine``,
    ``submit`` and ``sync_from``), None on the other ranks."""
    return engine_kind(cfg.kind).weight_sync(cfg, service, pause_mode)


@contextlib.contextmanager
def open_sandbox(cfg: SandboxConfig) -> Iterator[ClusterSandbox]:
    """A sandbox client for ``cfg`` (starting a LocalCluster when it has no address); closed on exit."""
    with contextlib.ExitStack() as stack:
        address = cfg.address
        if address is None:
            from sandbox_cluster import LocalCluster

            log.info("starting a local sandbox cluster with %d workers", cfg.workers)
            # The cluster's own lines follow this process's logging level, one step quieter at info (only
            # its problems; its start-up report of protections at debug), as `sandbox-cluster` does for its
            # throwaway clusters.
            level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
            level = level if level in ("debug", "warning", "error") else "warning"
            address = stack.enter_context(LocalCluster(workers=cfg.workers, log_level=level)).address
        sandbox = ClusterSandbox.connect(address)
        stack.callback(sandbox.close)
        yield sandbox


async def probe_engine(engine: GenerationEngine, tokenizer, *, timeout_s: float = 120.0, what: str = "engine") -> None:
    """One 1-token request; :class:`InfrastructureError` when the engine does not answer with a token."""
    prompt = list(tokenizer.encode("1 + 1 =", add_special_tokens=False)) or [0]
    try:
        gen = await asyncio.wait_for(engine.generate(prompt, SamplingParams(max_new_tokens=1, temperature=0.0)),
                                     timeout_s)
    except TimeoutError:
        raise InfrastructureError(f"{what} did not answer a 1-token request within {timeout_s:g} s") from None
    except Exception as exc:  # noqa: BLE001 - whatever the engine raised, it is not there
        raise InfrastructureError(f"{what} did not answer a 1-token request: {type(exc).__name__}: {exc}") from None
    if gen.finish_reason is FinishReason.ABORT or not gen.token_ids:
        raise InfrastructureError(f"{what} aborted a 1-token request (finish {gen.finish_reason.value})")


async def probe_sandbox(sandbox: Sandbox, *, timeout_s: float = 60.0, what: str = "sandbox") -> None:
    """Run ``print(1)``; :class:`InfrastructureError` unless it prints 1."""
    try:
        res = await asyncio.wait_for(sandbox.execute("print(1)", timeout=10.0, memory_mb=256), timeout_s)
    except TimeoutError:
        raise InfrastructureError(f"{what} did not run print(1) within {timeout_s:g} s") from None
    except Exception as exc:  # noqa: BLE001
        raise InfrastructureError(f"{what} did not run print(1): {type(exc).__name__}: {exc}") from None
    if res.status is not Status.OK or res.stdout != "1\n":
        raise InfrastructureError(f"{what} did not run print(1): {res.status.value} {res.message}".rstrip())



async def check_sandbox(sandbox: Sandbox, cfg: SandboxConfig, *, timeout_s: float | None = None) -> None:
    """The start-up check of eval and the trainer (before the engine loads): the sandbox runs ``print(1)``."""
    where = cfg.address or "the local sandbox cluster"
    await probe_sandbox(sandbox, timeout_s=timeout_s or cfg.probe_timeout_s, what=f"sandbox at {where}")


async def check_engine(engine: GenerationEngine, tokenizer, cfg: EngineConfig, *, timeout_s: float = 120.0) -> None:
    """The start-up check of eval and the trainer: the engine answers a 1-token request."""
    where = engine_kind(cfg.kind).where(cfg)
    await probe_engine(engine, tokenizer, timeout_s=timeout_s, what=f"engine {where}")


@dataclass(kw_only=True, slots=True)
class RolloutParts:
    """What a rollout needs beside its config: the sandbox (None without tools), the verifier,
    the engine and its tokenizer -- assembled and checked the same way by eval and the trainer."""
    sandbox: object | None
    verifier: object
    engine: GenerationEngine
    tokenizer: object


def open_rollout_parts(stack, run, *, engine_cfg: EngineConfig, sandbox_cfg: SandboxConfig, reward_cfg=None,
                       model_dir: Path | None = None, tools: bool = True, settings=None,
                       probe_timeout_s: float | None = None) -> RolloutParts:
    """Open the sandbox (and check that it runs a program), the answer checker and the engine
    (and check that it answers) into ``stack`` (a ``contextlib.ExitStack``: closing it closes
    them). ``run(coro)`` runs a coroutine on the event loop the engine will serve on."""
    from megatron_tir.reward import MathVerifier

    sandbox = None
    if tools:
        sandbox = stack.enter_context(open_sandbox(sandbox_cfg))
        run(check_sandbox(sandbox, sandbox_cfg, timeout_s=probe_timeout_s))
    verifier = stack.enter_context(MathVerifier(reward_cfg))
    engine, tokenizer = build_engine(engine_cfg, model_dir=model_dir, settings=settings)
    stack.callback(lambda: run(engine.close()))
    run(check_engine(engine, tokenizer, engine_cfg, **({} if probe_timeout_s is None else {"timeout_s": probe_timeout_s})))
    return RolloutParts(sandbox=sandbox, verifier=verifier, engine=engine, tokenizer=tokenizer)

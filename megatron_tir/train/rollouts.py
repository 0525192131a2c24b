"""Rank 0's rollout service: the generation engine, the sandbox cluster, the verifier and the
async rollout driver, kept alive across steps on one asyncio event loop that runs on its own
thread (:class:`~megatron_tir.rollout.event_loop.EventLoopThread`), so the main thread is free
while rollouts run. At start the sandbox and the engine are checked the way ``eval`` checks
them (``probe_sandbox`` / ``probe_engine``): a run does not start against one that is not there.

New weights reach the engine through its weight sync (``offload`` before training frees a
colocated engine's memory; ``sync_from`` after it loads the weights and resumes the engine);
with ``trainer.async=off`` / ``one_step`` a trajectory in flight never straddles a sync (a step's
rollouts have all finished before it); with ``full`` the sync retracts requests in flight
(``pause_mode``) and they continue under the new weights. The driver's requests go through an
:class:`~megatron_tir.rollout.instrument.EngineActivity` (the engine idle share).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence

from megatron_tir.data.problems import Problem
from megatron_tir.observe.heartbeat import phase_progress
from megatron_tir.rollout import Group, RolloutConfig, TIRRollout
from megatron_tir.rollout.engines.base import PauseMode
from megatron_tir.rollout.factory import EngineConfig, SandboxConfig, build_engine_sync, engine_kind, open_rollout_parts
from megatron_tir.rollout.event_loop import EventLoopThread
from megatron_tir.rollout.instrument import EngineActivity

log = logging.getLogger(__name__)


class RolloutService:
    """Owns the engine, the sandbox, the verifier and the event-loop thread on rank 0 (a context manager)."""

    def __init__(self, *, engine_cfg: EngineConfig, sandbox_cfg: SandboxConfig, reward_cfg=None, model_dir,
                 tools: bool = True, pause_mode: PauseMode = PauseMode.ABORT) -> None:
        self._stack = contextlib.ExitStack()
        self._stale_seen = 0
        self.pause_mode = pause_mode
        try:
            self._start(engine_cfg, sandbox_cfg, reward_cfg, model_dir, tools)
        except BaseException:
            self._stack.close()
            raise

    def _start(self, engine_cfg: EngineConfig, sandbox_cfg: SandboxConfig, reward_cfg, model_dir, tools: bool) -> None:
        self.runner = self._stack.enter_context(EventLoopThread())
        parts = open_rollout_parts(self._stack, self.runner.run, engine_cfg=engine_cfg, sandbox_cfg=sandbox_cfg,
                                   reward_cfg=reward_cfg, model_dir=model_dir, tools=tools)
        self.sandbox, self.verifier, self.engine, self.tokenizer = (parts.sandbox, parts.verifier, parts.engine,
                                                                    parts.tokenizer)
        self.activity = EngineActivity(self.engine)
        self._before_wait = engine_kind(engine_cfg.kind).before_wait
        # None where the kind's weights go from every rank (the weight push's WeightSync)
        self.weight_sync = build_engine_sync(engine_cfg, self.engine, pause_mode=self.pause_mode)
        if self.weight_sync is not None:
            self.runner.run(self.weight_sync.start())
            self._stack.callback(lambda: self.runner.run(self.weight_sync.close()))

    def submit(self, coro):
        """Schedule ``coro`` on the service's event loop; a ``concurrent.futures.Future`` of its result."""
        return self.runner.submit(coro)

    def rollout(self, problems: Sequence[Problem], config: RolloutConfig, *, group_id_offset: int = 0,
                progress: bool = False, desc: str = "rollout") -> list[Group]:
        return self.runner.run(self.arollout(problems, config, group_id_offset=group_id_offset, progress=progress,
                                             desc=desc))

    async def arollout(self, problems: Sequence[Problem], config: RolloutConfig, *, group_id_offset: int = 0,
                       progress: bool = False, desc: str = "rollout") -> list[Group]:
        driver = TIRRollout(self.activity, self.tokenizer, self.sandbox, config, verifier=self.verifier)
        if not progress:
            return await driver.run(problems, group_id_offset=group_id_offset)
        # a bar on a terminal, a heartbeat line every minute in a log file (megatron_tir.observe.heartbeat)
        with phase_progress(desc, len(problems) * config.n_samples, unit="traj") as bar:
            return await driver.run(problems, group_id_offset=group_id_offset,
                                    on_done=lambda t: bar.update(1, tokens=t.num_model_tokens))

    def waiting(self) -> None:
        """The calling thread is about to wait for the engine's work: what the engine kind asks of it
        first (the local engine: hand back its idle OpenMP team; ``EngineKind.before_wait``)."""
        if self._before_wait is not None:
            self._before_wait()

    def take_stale_responses(self) -> int:
        """Answers the engine dropped since the last call because their server served older
        weights (it restarted; the SGLang client retries them elsewhere)."""
        total = getattr(self.engine, "stale_responses", 0)
        new, self._stale_seen = total - self._stale_seen, total
        return new

    def offload(self) -> None:
        """Before a training phase: the engine pauses and frees its memory where it shares the
        trainer's devices (colocated SGLang, the local engine); ``sync_from`` takes it back."""
        if self.weight_sync is not None:
            self.runner.run(self.weight_sync.offload())

    def engine_busy_s(self) -> float:
        """Seconds so far with at least one generation request in flight and no sync under way (cumulative)."""
        return self.activity.busy_s()

    @property
    def weight_version(self) -> int:
        """The engine's weight version now (one more after every sync)."""
        return self.engine.weight_version

    def sync_from(self, source, *, version: int | None = None) -> int:
        """Rank 0's side of a :class:`~megatron_tir.rollout.sync.base.Rank0WeightSync`: ``source``'s
        (a :class:`~megatron_tir.policy.weight_source.WeightSource`) current weights into the engine,
        on the service's event loop; returns its new weight version (collective: the other ranks
        drain ``source.named_hf_buckets()`` at the same time)."""
        if self.weight_sync is None:
            raise RuntimeError("this engine is synced from every rank (WeightPush.update)")
        if version is not None:  # a resumed run continues its numbering (EngineWeightSync.next_version)
            self.weight_sync.next_version = version
        with self.activity.paused():
            return self.runner.run(self.weight_sync.update(source.named_hf_buckets()))

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> RolloutService:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

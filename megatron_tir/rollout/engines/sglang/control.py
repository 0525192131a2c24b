"""The control surface of :class:`~megatron_tir.rollout.engines.sglang.client.SGLangEngine`: calls
that go to every server at once and change what they hold -- pause and resume, the weight-update
session and group, ``update_weights_from_*``, ``flush_cache``, memory release and resume, and the
``/server_info`` they check against. Only the weight sync (:mod:`megatron_tir.rollout.sync.sglang`)
drives them; generation, health and the weight-version reads stay in ``client``. "Every server" is
``sync_targets``: the servers the current sync addresses (all of them, unless one did not answer
before it, see ``SGLangEngine.wait_servers_back``).

``SGLangControl`` is a mixin of ``SGLangEngine`` (one object, so the engine's public methods are
unchanged): it uses the engine's ``config``, ``pool``, ``start()``, ``_post`` and ``_get_json`` and
the state the engine initialises. Endpoints and payloads follow sglang 0.5.23
(``srt/entrypoints/http_server.py``, ``srt/managers/tokenizer_control_mixin.py``,
``srt/managers/io_struct.py``); the semantics are in the client's module docstring (Control).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp

from megatron_tir.rollout.engines.base import (
    DEFAULT_PAUSE_MODE,
    MEMORY_TAGS,
    PauseMode,
    check_release,
    check_resume,
    pause_mode,
)
from megatron_tir.rollout.engines.sglang.pool import ServerPool, ServerState
from megatron_tir.rollout.engines.sglang.wire import SGLangError, error_message, parse_weight_version

log = logging.getLogger(__name__)


class SGLangControl:
    """Every-server control calls (see the module docstring); mixed into ``SGLangEngine``."""

    # set by SGLangEngine.__init__ / start()
    pool: ServerPool
    paused: bool
    released_memory: tuple[str, ...]
    _released_on: dict[str, tuple[str, ...]]
    _server_info: dict[str, dict[str, Any]]
    sync_targets: list[ServerState]
    _weight_version: int
    _admitting: asyncio.Event | None

    # ------------------------------------------------------------------ control calls (all servers)

    async def call_all(self, path: str, payload: dict[str, Any] | None = None, *,
                       payload_for: Callable[[int], dict[str, Any]] | None = None,
                       fail_fast: bool = False, servers: Sequence[ServerState] | None = None,
                       timeout_s: float | None = None) -> list[Any]:
        """POST ``path`` to every server of the sync (or to ``servers``) at once; SGLangError listing
        each server that failed.

        ``payload_for(i)`` gives server i its own payload (e.g. its rank offset). With
        ``fail_fast`` the first failure raises at once (the other calls are cancelled). ``timeout_s``:
        each call's bound (None: the config's ``control_timeout_s``).
        """
        results = await self._call_each(path, payload, payload_for=payload_for, fail_fast=fail_fast, servers=servers,
                                        timeout_s=timeout_s)
        errors = [r for r in results if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError)]
        if errors:
            raise SGLangError("; ".join(str(e) for e in errors))
        return results

    async def _call_each(self, path: str, payload: dict[str, Any] | None, *,
                         payload_for: Callable[[int], dict[str, Any]] | None = None,
                         fail_fast: bool = False, servers: Sequence[ServerState] | None = None,
                         timeout_s: float | None = None) -> list[Any]:
        """POST ``path`` to every server at once; per server its answer or its SGLangError."""
        await self.start()
        timeout_s = self.config.control_timeout_s if timeout_s is None else timeout_s

        async def one(i: int, server: ServerState) -> Any:
            body = payload_for(i) if payload_for is not None else payload
            status, answer = await self._control_post(server, path, body, timeout_s)
            success = answer.get("success", True) if isinstance(answer, dict) else True
            if status != 200 or success is False:
                raise SGLangError(f"{server.url}{path} answered {status}: {error_message(answer)}")
            return answer

        tasks = [asyncio.ensure_future(one(i, s)) for i, s in enumerate(self.sync_targets if servers is None else servers)]
        try:
            if fail_fast:
                done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
            return await asyncio.gather(*tasks, return_exceptions=True)
        finally:  # the caller cancelled (a timeout around the call): the calls go too, not left to fail unread
            for task in tasks:
                task.cancel()

    async def _control_post(self, server: ServerState, path: str, body: Any, timeout_s: float) -> tuple[int, Any]:
        """One control call: (status, answer), or SGLangError naming the server and path (no answer within
        ``timeout_s``, or the connection's error)."""
        try:
            return await self._post(server.url, path, body, timeout_s)
        except TimeoutError as exc:
            raise SGLangError(f"{server.url}{path}: no answer within {timeout_s:g} s") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise SGLangError(f"{server.url}{path}: {exc!r}") from exc

    async def server_info(self, *, refresh: bool = False) -> list[dict[str, Any]]:
        """``GET /server_info`` of every server of the sync (cached per server), in their order;
        SGLangError unless each has dp_size 1 and, when the config names one, the expected tp_size."""
        targets = list(self.sync_targets)
        if not refresh and all(s.url in self._server_info for s in targets):
            return [self._server_info[s.url] for s in targets]
        await self.start()

        async def one(server: ServerState) -> dict[str, Any]:
            timeout = aiohttp.ClientTimeout(total=self.config.control_timeout_s,
                                            sock_connect=self.config.connect_timeout_s)
            info = await self._get_json(server, "/server_info", timeout)
            tp, dp = info.get("tp_size"), info.get("dp_size")
            if not isinstance(tp, int) or tp < 1 or not isinstance(dp, int):
                raise SGLangError(f"{server.url}/server_info has no usable tp_size/dp_size: {tp!r}/{dp!r}")
            if dp != 1:
                raise SGLangError(f"{server.url} runs dp_size={dp}; SGLang updates weights only with dp_size 1 "
                                  "(run one server per data-parallel replica)")
            if self.config.tp_size is not None and tp != self.config.tp_size:
                raise SGLangError(f"{server.url} runs tp_size={tp}, the config expects {self.config.tp_size}")
            return info

        infos = list(await asyncio.gather(*(one(s) for s in targets)))
        self._server_info.update((s.url, info) for s, info in zip(targets, infos))
        return infos

    async def pause(self, *, mode: PauseMode | str = DEFAULT_PAUSE_MODE) -> None:
        """Stop admitting requests here and ``/pause_generation`` on every server.

        ``ABORT``: running requests return ABORT with their partial output; ``RETRACT`` /
        ``IN_PLACE``: they wait on the server and continue after ``resume``.
        """
        mode = pause_mode(mode)
        await self.start()
        self.paused = True
        self._admitting.clear()
        await self.call_all("/pause_generation", {"mode": mode.value})

    async def resume(self) -> None:
        """``/continue_generation`` on every server; each that answers is healthy again, each
        that does not is marked down (requests go to the others). SGLangError if none answers."""
        targets = list(self.sync_targets)
        results = await self._call_each("/continue_generation", {}, servers=targets,
                                        timeout_s=self.config.quick_control_timeout_s)
        for server, result in zip(targets, results, strict=True):
            if isinstance(result, BaseException):
                self.pool.mark_down(server, f"/continue_generation failed: {result}")
            else:
                self.pool.mark_up(server)
        self.paused = False
        self._admitting.set()
        if all(isinstance(r, BaseException) for r in results):
            raise SGLangError("; ".join(str(r) for r in results))

    async def begin_weight_update(self) -> None:
        """Open a weight-update session on every server (updates are refused outside one)."""
        await self.call_all("/begin_weight_update", {}, timeout_s=self.config.quick_control_timeout_s)

    async def end_weight_update(self) -> None:
        await self.call_all("/end_weight_update", {}, timeout_s=self.config.quick_control_timeout_s)

    async def flush_cache(self, timeout_s: float | None = None) -> None:
        """Drop the radix (prefix) cache on every server, retrying a refusal for up to
        ``timeout_s`` (default: the config's ``flush_timeout_s``).

        SGLang flushes only an idle scheduler: right after an abort it may still hold the
        batch (400), so the call is retried. A paused scheduler ignores its waiting queue
        (retracted requests) for this check, but the deferred form ``?timeout=S`` does not
        -- it would wait for them forever -- so it is not used.
        """
        await self.start()
        wait = self.config.flush_timeout_s if timeout_s is None else timeout_s

        async def one(server: ServerState) -> None:
            deadline = asyncio.get_running_loop().time() + wait
            while True:
                # one try: the scheduler answers at once, flushed or not (its deferred form is not used)
                status, answer = await self._control_post(server, "/flush_cache", None,
                                                          self.config.quick_control_timeout_s)
                if status == 200:
                    return
                if status != 400 or asyncio.get_running_loop().time() >= deadline:
                    raise SGLangError(f"{server.url}/flush_cache answered {status} (for {wait:.0f}s): "
                                      f"{error_message(answer).strip()}")
                await asyncio.sleep(0.05)

        results = await asyncio.gather(*(one(s) for s in self.sync_targets), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise SGLangError("; ".join(str(e) for e in errors))

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Free GPU memory (``weights``, ``kv_cache``, ``cuda_graph``; None: all) while paused.

        The servers must run with ``--enable-memory-saver`` (without it nothing is freed).
        """
        tags = tuple(MEMORY_TAGS if tags is None else tags)
        released = check_release(self.released_memory, tags, paused=self.paused)
        targets = list(self.sync_targets)
        no_saver = [s.url for s, info in zip(targets, await self.server_info())
                    if not info.get("enable_memory_saver")]
        if no_saver:
            raise SGLangError(f"{', '.join(no_saver)} run(s) without --enable-memory-saver: release frees nothing")
        await self.call_all("/release_memory_occupation", {"tags": list(tags)}, servers=targets)
        self.released_memory = released
        for server in targets:
            self._released_on[server.url] = tuple(dict.fromkeys(self._released_on.get(server.url, ()) + tags))

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Take back the memory released (None: exactly the tags released; nothing: no call).

        A server that restarted since the release (seen through its weight version) holds
        nothing released and is skipped: resuming a tag it never released kills its scheduler
        (``offload_tags.remove``, fake_sglang.py rule 4)."""
        tags = self.released_memory if tags is None else tuple(tags)
        if not tags:
            return
        still = check_resume(self.released_memory, tags)
        targets = [s for s in self.sync_targets if set(tags) <= set(self._released_on.get(s.url, ()))]
        skipped = [s.url for s in self.sync_targets if s not in targets]
        if skipped:
            log.warning("not resuming %s on %s: restarted since the release", list(tags), ", ".join(skipped))
        if targets:
            await self.call_all("/resume_memory_occupation", {"tags": list(tags)}, servers=targets)
        for server in targets:
            self._released_on[server.url] = tuple(t for t in self._released_on[server.url] if t not in tags)
        self.released_memory = still

    async def init_weights_update_group(self, *, master_address: str, master_port: int, group_name: str,
                                        backend: str = "nccl") -> int:
        """Ask every server to join the trainer's broadcast group; returns its world size.

        Rank 0 is the trainer; server i's TP ranks follow those of servers 0..i-1 (the sync's
        servers, tp sizes from ``/server_info``). Fails at the first server that cannot join.
        """
        targets = list(self.sync_targets)
        tp_sizes = [info["tp_size"] for info in await self.server_info()]
        offsets = [1 + sum(tp_sizes[:i]) for i in range(len(tp_sizes))]
        world_size = 1 + sum(tp_sizes)
        await self.call_all("/init_weights_update_group", fail_fast=True, servers=targets, payload_for=lambda i: {
            "master_address": master_address, "master_port": int(master_port),
            "rank_offset": offsets[i], "world_size": world_size,
            "group_name": group_name, "backend": backend,
        })
        return world_size

    async def destroy_weights_update_group(self, group_name: str, *, best_effort: bool = False) -> None:
        """Leave the group on every server; ``best_effort``: a server that cannot (it restarted
        and never joined, or is gone) is logged, not raised."""
        if not best_effort:
            await self.call_all("/destroy_weights_update_group", {"group_name": group_name})
            return
        for result in await self._call_each("/destroy_weights_update_group", {"group_name": group_name}):
            if isinstance(result, BaseException):
                log.info("leaving weight-update group %s: %s", group_name, result)

    async def update_weights_from_distributed(self, *, names: Sequence[str], dtypes: Sequence[str],
                                              shapes: Sequence[Sequence[int]], group_name: str,
                                              weight_version: str | None = None,
                                              load_format: str | None = None) -> None:
        """Announce one bucket of tensors; the group's rank 0 broadcasts them meanwhile (one
        tensor each, or with ``load_format="flattened_bucket"`` one uint8 tensor of them all).

        ``flush_cache`` is false: the sync flushes once, after ``end_weight_update``.
        """
        payload = {"names": list(names), "dtypes": list(dtypes), "shapes": [list(map(int, s)) for s in shapes],
                   "group_name": group_name, "flush_cache": False}
        if load_format is not None:
            payload["load_format"] = load_format
        version = None if weight_version is None else parse_weight_version(weight_version, where="weight_version")
        if weight_version is not None:
            payload["weight_version"] = weight_version
        targets = list(self.sync_targets)
        await self.call_all("/update_weights_from_distributed", payload, servers=targets)
        if version is not None:
            self._weight_version = version
            self.pool.mark_fresh(targets)

    async def update_weights_from_tensor(self, payloads: Sequence[Sequence[str]], *, load_format: str | None = None,
                                         weight_version: str | None = None) -> None:
        """Colocated sync: ``payloads[i]`` is server i's list, one base64 MultiprocessingSerializer
        dump per TP rank (see ``megatron_tir.rollout.sync.sglang.serialize_for_tp_ranks``)."""
        targets = list(self.sync_targets)
        tp_sizes = [info["tp_size"] for info in await self.server_info()]
        version = None if weight_version is None else parse_weight_version(weight_version, where="weight_version")
        if len(payloads) != len(tp_sizes):
            raise ValueError(f"update_weights_from_tensor: {len(payloads)} payload lists for {len(tp_sizes)} servers")
        for server, payload, tp in zip(targets, payloads, tp_sizes):
            if len(payload) != tp:
                raise ValueError(f"update_weights_from_tensor: {server.url} has tp_size {tp}, got {len(payload)} "
                                 "serialized payloads (one per TP rank)")

        def body(i: int) -> dict[str, Any]:
            out: dict[str, Any] = {"serialized_named_tensors": list(payloads[i]), "flush_cache": False}
            if load_format is not None:
                out["load_format"] = load_format
            if weight_version is not None:
                out["weight_version"] = weight_version
            return out

        await self.call_all("/update_weights_from_tensor", payload_for=body, servers=targets)
        if version is not None:
            self._weight_version = version
            self.pool.mark_fresh(targets)

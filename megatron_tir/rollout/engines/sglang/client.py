"""SGLang servers behind the GenerationEngine interface (HTTP client; the servers run on GPUs).

One file on purpose (about 640 lines): it is one class, ``SGLangEngine``, whose methods are the
servers' HTTP surface; the wire format (:mod:`.wire`) and server choice (:mod:`.pool`) are already
apart. The next cut, when it grows, is the control surface (weight updates, memory, flush) into
its own module called by the weight sync.

The wire format is in :mod:`.wire`, server choice in :mod:`.pool`. Endpoints, payloads and
status codes follow sglang 0.5.23 (``srt/entrypoints/http_server.py``,
``srt/managers/tokenizer_control_mixin.py``, ``srt/managers/io_struct.py``).

Failures
    A request is retried on another server only when that is safe: the connection was
    refused or timed out while connecting (the request never reached a server), or the
    server answered 5xx without a result. A connection lost after the request was sent is
    not retried (the server may still be generating); it returns an ABORT generation with
    ``meta["error"]``. A 4xx answer raises ValueError (the request is wrong), an answer
    that breaks the schema raises :class:`SGLangError`. Idle connections are dropped after
    ``keepalive_timeout_s``, below the server's 5 s (uvicorn ``timeout_keep_alive``,
    ``SGLANG_TIMEOUT_KEEP_ALIVE``), so a request never goes out on a connection the
    server is closing.

Health
    A background task polls ``GET /health`` and brings servers back when they answer 200.
    SGLang's ``/health`` is a generation probe: it sleeps about 1 s, and while generation
    is paused it waits (up to 20 s, then 503). So health checks are suspended from
    ``pause()`` to ``resume()``, and ``resume()`` marks up every server that accepted
    ``/continue_generation``.

Control (every server at once; only the weight sync, :mod:`megatron_tir.rollout.sync.sglang`,
drives them)
    ``pause``/``resume`` (``/pause_generation`` with a PauseMode, ``/continue_generation``),
    ``server_info`` (``GET /server_info``: ``tp_size``, ``dp_size`` must be 1),
    ``begin_weight_update``/``end_weight_update`` (a session; SGLang refuses weight
    updates outside one), ``init_weights_update_group``, ``update_weights_from_distributed``,
    ``update_weights_from_tensor`` (both with ``flush_cache: false``), ``flush_cache``
    (retried while the scheduler still holds requests, up to ``flush_timeout_s``), and
    ``release_memory_occupation``/``resume_memory_occupation`` (only while paused; resume
    exactly the tags released -- SGLang's scheduler dies resuming a tag it did not release).

Restarts
    A server restarted (by the launcher's agent) comes back with its launch weights,
    ``"default"``. Every ``/generate`` answer carries ``meta_info.weight_version`` (the
    version of its last token, ``srt/utils/weight_versions.py``): an answer older than the
    version the engine held when the request was sent is dropped and the request retried
    on another server (``stale_responses`` counts them; when no other server is left the
    request returns ABORT with ``meta["stale"]``), and that server gets no work until a
    weight sync brings it up to date (``pool.mark_stale``; the sync rebuilds what it needs,
    see :mod:`megatron_tir.rollout.sync.sglang`). A health check that finds a server back
    after it was down also reads its version (``/model_info``) before giving it work.

Weight version
    ``weight_version`` is the servers' version as an int (SGLang's ``"default"`` at launch
    is 0): read with ``fetch_weight_version`` (``GET /model_info``) and set by every
    successful ``update_weights_from_*`` that carries one. Each generated token's version
    comes from ``meta_info.weight_versions`` (``Generation.versions``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from megatron_tir.rollout.engines.base import (
    DEFAULT_PAUSE_MODE,
    FinishReason,
    Generation,
    PauseMode,
    SamplingParams,
    bind_event_loop,
    MEMORY_TAGS,
    check_generate_args,
    check_release,
    check_resume,
    pause_mode,
)
from megatron_tir.rollout.engines.sglang.pool import ServerPool, ServerState
from megatron_tir.rollout.engines.sglang.wire import (
    SGLangError,
    build_generate_request,
    error_message,
    parse_generate_response,
    parse_weight_version,
)

log = logging.getLogger(__name__)

SERVER_KEEPALIVE_S = 5.0  # sglang/srt/environ.py SGLANG_TIMEOUT_KEEP_ALIVE default
_CONNECT_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)  # never reached the server


@dataclass(kw_only=True, slots=True)
class SGLangEngineConfig:
    """Where the servers are and how to talk to them."""

    server_urls: tuple[str, ...]  # e.g. ("http://10.0.0.5:30000",)
    eos_token_ids: tuple[int, ...]  # see megatron_tir.rollout.engines.eos.resolve_eos_token_ids
    tp_size: int | None = None  # expected GPUs per server, checked against /server_info; None: any
    request_timeout_s: float = 3600.0  # one /generate call
    connect_timeout_s: float = 10.0
    control_timeout_s: float = 600.0  # weight sync, flush, pause, memory calls
    flush_timeout_s: float = 60.0  # how long /flush_cache is retried while the scheduler is busy
    health_check_interval_s: float = 5.0  # 0: none (a server marked down then stays down until check_health())
    health_timeout_s: float = 10.0  # > the ~1 s SGLang's /health sleeps before answering
    keepalive_timeout_s: float = 4.0  # idle connections are dropped before the server's 5 s
    max_attempts: int = 3  # servers tried per request (safe failures only)
    retry_backoff_s: float = 0.2
    max_route_keys: int = 100_000  # sticky-routing table size (see pool.py)

    def __post_init__(self) -> None:
        self.server_urls = tuple(str(u).rstrip("/") for u in self.server_urls)
        if not self.server_urls:
            raise ValueError("server_urls is empty")
        bad = [u for u in self.server_urls if not u.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"server_urls must start with http:// or https://, got {bad}")
        if len(set(self.server_urls)) != len(self.server_urls):
            raise ValueError(f"server_urls has duplicates: {self.server_urls}")
        self.eos_token_ids = tuple(int(t) for t in self.eos_token_ids)
        if not self.eos_token_ids or any(t < 0 for t in self.eos_token_ids):
            raise ValueError(f"eos_token_ids must be non-empty and non-negative, got {self.eos_token_ids}")
        if self.tp_size is not None and self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        for name in ("request_timeout_s", "connect_timeout_s", "control_timeout_s", "flush_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.health_timeout_s > 1.0:
            raise ValueError(f"health_timeout_s must be > 1 (SGLang's /health sleeps ~1 s), "
                             f"got {self.health_timeout_s}")
        if not 0 < self.keepalive_timeout_s < SERVER_KEEPALIVE_S:
            raise ValueError(f"keepalive_timeout_s must be in (0, {SERVER_KEEPALIVE_S}) (the server closes idle "
                             f"connections after {SERVER_KEEPALIVE_S} s), got {self.keepalive_timeout_s}")
        if self.health_check_interval_s < 0:
            raise ValueError(f"health_check_interval_s must be >= 0, got {self.health_check_interval_s}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.retry_backoff_s < 0:
            raise ValueError(f"retry_backoff_s must be >= 0, got {self.retry_backoff_s}")
        if self.max_route_keys < 1:
            raise ValueError(f"max_route_keys must be >= 1, got {self.max_route_keys}")


class SGLangEngine:
    """GenerationEngine over one or more SGLang servers (see the module docstring).

    ``async with SGLangEngine(SGLangEngineConfig(server_urls=(...), eos_token_ids=(...))) as e:``
    """

    def __init__(self, config: SGLangEngineConfig) -> None:
        self.config = config
        self.eos_token_ids: tuple[int, ...] = config.eos_token_ids
        self.pool = ServerPool(config.server_urls, max_keys=config.max_route_keys)
        self.paused = False  # between pause() and resume(): health checks are suspended
        self.released_memory: tuple[str, ...] = ()  # tags released on every server, not yet resumed
        self._released_on: dict[str, tuple[str, ...]] = {}  # per server URL: what it holds released
        self._server_info: list[dict[str, Any]] | None = None
        self._weight_version = 0
        self.stale_responses = 0  # answers dropped because their server served older weights
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._health_task: asyncio.Task | None = None
        self._admitting: asyncio.Event | None = None
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    @property
    def weight_version(self) -> int:
        """The servers' weight version (see the module docstring)."""
        return self._weight_version

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the engine is bound to (None until first used)."""
        return self._loop

    async def start(self) -> None:
        """Open the HTTP session and start health checks (``generate`` does this on first use)."""
        if self._closed:
            raise RuntimeError("SGLangEngine is closed")
        self._loop = bind_event_loop(self._loop, "SGLangEngine")
        if self._session is not None:
            return
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s),
            connector=aiohttp.TCPConnector(limit=0,  # many long generations in flight
                                           keepalive_timeout=self.config.keepalive_timeout_s),
        )
        self._admitting = asyncio.Event()
        self._admitting.set()
        if self.config.health_check_interval_s > 0:
            self._health_task = self._loop.create_task(self._health_loop(), name="sglang-health")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._health_task is not None:
            self._health_task.cancel()
            try:
                await self._health_task
            except asyncio.CancelledError:
                pass
        if self._session is not None:
            await self._session.close()

    async def __aenter__(self) -> SGLangEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ------------------------------------------------------------------ health

    async def check_health(self) -> dict[str, bool]:
        """GET /health on every server now; updates the pool; returns url -> healthy."""
        await self.start()
        results = await asyncio.gather(*(self._check_one(s) for s in self.pool.servers))
        return {s.url: ok for s, ok in zip(self.pool.servers, results)}

    async def wait_healthy(self, timeout_s: float = 600.0, *, poll_s: float = 1.0, require_all: bool = True) -> None:
        """Wait until every server (or, with ``require_all=False``, one) answers /health with 200."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            status = await self.check_health()
            if all(status.values()) if require_all else any(status.values()):
                return
            if asyncio.get_running_loop().time() >= deadline:
                down = [f"{s.url} ({s.last_error})" for s in self.pool.servers if not s.healthy]
                raise SGLangError(f"SGLang servers not healthy after {timeout_s:.0f}s: {', '.join(down)}")
            await asyncio.sleep(poll_s)

    async def _check_one(self, server: ServerState) -> bool:
        try:
            async with self._session.get(f"{server.url}/health",
                                         timeout=aiohttp.ClientTimeout(total=self.config.health_timeout_s)) as r:
                ok = r.status == 200
                why = f"/health answered {r.status}"
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            ok, why = False, f"/health failed: {exc!r}"
        if self.paused:  # the probe waited on a pause that began meanwhile: it says nothing
            return ok
        if ok and not server.healthy:  # back after it was down: it may have restarted with other weights
            try:
                served = await self.server_weight_version(server, self.config.health_timeout_s)
            except SGLangError as exc:
                ok, why = False, str(exc)
            else:
                if served != self._weight_version:
                    self._mark_restarted(server, f"weight version {served}, the engine's is {self._weight_version}")
        if ok:
            self.pool.mark_up(server)
        else:
            self.pool.mark_down(server, why)
        return ok

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_check_interval_s)
            if not self.paused:
                await asyncio.gather(*(self._check_one(s) for s in self.pool.servers))

    # ------------------------------------------------------------------ generate

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        prompt = check_generate_args(prompt_ids, params)
        await self.start()
        await self._admitting.wait()
        rid = uuid.uuid4().hex
        payload = build_generate_request(prompt, params, rid=rid, stop_token_ids=self.eos_token_ids)
        tried: list[ServerState] = []
        failures: list[str] = []
        sent_version, stale = self._weight_version, None
        for attempt in range(self.config.max_attempts):
            server = self.pool.pick(exclude=tried, key=params.route_key)
            if server is None:
                break
            tried.append(server)
            server.in_flight += 1
            try:
                status, body = await self._post(server.url, "/generate", payload, self.config.request_timeout_s)
            except _CONNECT_ERRORS as exc:  # never reached the server: safe to retry
                self.pool.mark_down(server, f"connect failed: {exc!r}")
                failures.append(f"{server.url}: connect failed ({exc!r})")
                await asyncio.sleep(self.config.retry_backoff_s * attempt)
                continue
            except (TimeoutError, aiohttp.ClientError) as exc:  # sent, then lost: not retried
                self.pool.mark_down(server, f"/generate failed after sending: {exc!r}")
                return Generation(token_ids=[], logprobs=[], finish_reason=FinishReason.ABORT,
                                  prompt_tokens=len(prompt),
                                  meta={"server": server.url, "error": f"{type(exc).__name__}: {exc}"})
            except asyncio.CancelledError:
                self._abort_on_server(server.url, rid)
                raise
            finally:
                server.in_flight -= 1
            if status >= 500:  # the server answered without a result: retry elsewhere
                self.pool.mark_down(server, f"/generate answered {status}")
                failures.append(f"{server.url}: {status} {error_message(body)}")
                await asyncio.sleep(self.config.retry_backoff_s * attempt)
                continue
            if status != 200:
                raise ValueError(f"SGLang {server.url} rejected the request ({status}): {error_message(body)}")
            gen = parse_generate_response(body, prompt_tokens=len(prompt), eos_token_ids=self.eos_token_ids,
                                          server=server.url)
            served = gen.versions[-1] if gen.versions else parse_weight_version(
                gen.meta.get("weight_version"), where="meta_info.weight_version")
            if served < sent_version:  # the server missed a sync (it restarted): drop the answer
                self.stale_responses += 1
                self._mark_restarted(server, f"answered with weight version {served}, the engine's is {sent_version}")
                failures.append(f"{server.url}: stale weights (version {served} < {sent_version})")
                stale = gen
                continue
            return gen
        behind = [s.url for s in self.pool.servers if s.stale and s.healthy]
        if stale is not None or (behind and not failures):  # no up-to-date server: flagged, never trained
            why = f"only stale answers: {'; '.join(failures)}" if stale is not None else (
                f"the healthy servers {behind} serve stale weights until the next sync")
            return Generation(token_ids=[], logprobs=[], finish_reason=FinishReason.ABORT, prompt_tokens=len(prompt),
                              meta={"server": stale.meta.get("server") if stale else None, "stale": True,
                                    "error": why})
        if not failures:
            down = ", ".join(f"{s.url} ({s.last_error})" for s in self.pool.servers)
            raise SGLangError(f"no healthy SGLang server: {down}")
        raise SGLangError(f"/generate failed on {len(failures)} server(s): {'; '.join(failures)}")

    def _abort_on_server(self, url: str, rid: str) -> None:
        """Best effort: tell the server to stop a request whose caller went away."""
        async def abort() -> None:
            try:
                await self._post(url, "/abort_request", {"rid": rid}, self.config.health_timeout_s)
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                log.debug("abort of %s on %s failed: %r", rid, url, exc)

        if self._session is not None and not self._session.closed:
            asyncio.get_running_loop().create_task(abort())

    async def _post(self, url: str, path: str, payload: Any, timeout_s: float) -> tuple[int, Any]:
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=self.config.connect_timeout_s)
        async with self._session.post(f"{url}{path}", json=payload, timeout=timeout) as response:
            text = await response.text()
        try:
            body = json.loads(text) if text else None
        except ValueError:
            body = text
        return response.status, body

    # ------------------------------------------------------------------ control calls (all servers)

    async def call_all(self, path: str, payload: dict[str, Any] | None = None, *,
                       payload_for: Callable[[int], dict[str, Any]] | None = None,
                       fail_fast: bool = False, servers: Sequence[ServerState] | None = None) -> list[Any]:
        """POST ``path`` to every server (or to ``servers``) at once; SGLangError listing each server
        that failed.

        ``payload_for(i)`` gives server i its own payload (e.g. its rank offset). With
        ``fail_fast`` the first failure raises at once (the other calls are cancelled).
        """
        results = await self._call_each(path, payload, payload_for=payload_for, fail_fast=fail_fast, servers=servers)
        errors = [r for r in results if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError)]
        if errors:
            raise SGLangError("; ".join(str(e) for e in errors))
        return results

    async def _call_each(self, path: str, payload: dict[str, Any] | None, *,
                         payload_for: Callable[[int], dict[str, Any]] | None = None,
                         fail_fast: bool = False, servers: Sequence[ServerState] | None = None) -> list[Any]:
        """POST ``path`` to every server at once; per server its answer or its SGLangError."""
        await self.start()

        async def one(i: int, server: ServerState) -> Any:
            body = payload_for(i) if payload_for is not None else payload
            try:
                status, answer = await self._post(server.url, path, body, self.config.control_timeout_s)
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                raise SGLangError(f"{server.url}{path}: {exc!r}") from exc
            success = answer.get("success", True) if isinstance(answer, dict) else True
            if status != 200 or success is False:
                raise SGLangError(f"{server.url}{path} answered {status}: {error_message(answer)}")
            return answer

        tasks = [asyncio.ensure_future(one(i, s)) for i, s in enumerate(self.pool.servers if servers is None else servers)]
        if fail_fast:
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        return await asyncio.gather(*tasks, return_exceptions=True)

    async def server_info(self, *, refresh: bool = False) -> list[dict[str, Any]]:
        """``GET /server_info`` of every server (cached); SGLangError unless each has dp_size 1
        and, when the config names one, the expected tp_size."""
        if self._server_info is not None and not refresh:
            return self._server_info
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

        self._server_info = list(await asyncio.gather(*(one(s) for s in self.pool.servers)))
        return self._server_info

    async def _get_json(self, server: ServerState, endpoint: str, timeout) -> dict[str, Any]:
        """``GET server.url + endpoint`` as a JSON object; SGLangError naming the server otherwise."""
        try:
            async with self._session.get(f"{server.url}{endpoint}", timeout=timeout) as response:
                status, text = response.status, await response.text()
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise SGLangError(f"{server.url}{endpoint}: {exc!r}") from exc
        try:
            info = json.loads(text)
        except ValueError:
            info = None
        if status != 200 or not isinstance(info, dict):
            raise SGLangError(f"{server.url}{endpoint} answered {status}: {text[:200]}")
        return info

    async def server_weight_version(self, server: ServerState, timeout_s: float) -> int:
        """One server's live weight version (``GET /model_info``); SGLangError naming it otherwise."""
        await self.start()
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=min(timeout_s, self.config.connect_timeout_s))
        info = await self._get_json(server, "/model_info", timeout)
        return parse_weight_version(info.get("weight_version"), where=f"{server.url}/model_info")

    async def wait_servers_back(self, timeout_s: float, *, poll_s: float = 0.2) -> list[ServerState]:
        """Before a sync: every server answers ``/model_info`` within ``timeout_s`` (a restarting
        one is waited for); returns the servers whose version is not the engine's (restarted),
        marked stale. SGLangError naming each server that did not answer in time."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s

        async def one(server: ServerState) -> int:
            while True:
                left = deadline - loop.time()
                try:
                    return await asyncio.wait_for(self.server_weight_version(server, max(left, 0.05)), max(left, 0.05))
                except (SGLangError, TimeoutError) as exc:
                    if loop.time() + poll_s >= deadline:
                        raise SGLangError(f"{server.url} did not answer within {timeout_s:g}s, so the weight sync "
                                          f"cannot complete: {exc}") from None
                await asyncio.sleep(poll_s)

        results = await asyncio.gather(*(one(s) for s in self.pool.servers), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise SGLangError("; ".join(str(e) for e in errors))
        behind = []
        for server, version in zip(self.pool.servers, results):
            if version != self._weight_version:
                self._mark_restarted(server, f"weight version {version}, the engine's is {self._weight_version}")
                behind.append(server)
        return behind

    async def fetch_weight_version(self) -> int:
        """``GET /model_info`` of every server; records and returns their (highest) weight version.

        SGLang 0.5.23 reports the live version there (``/server_info`` holds the launch value).
        """
        await self.start()
        versions = await asyncio.gather(*(self.server_weight_version(s, self.config.control_timeout_s)
                                          for s in self.pool.servers))
        if len(set(versions)) > 1:
            log.warning("SGLang servers hold different weight versions %s; the next sync aligns them",
                        dict(zip((s.url for s in self.pool.servers), versions)))
        self._weight_version = max(versions)
        for server, version in zip(self.pool.servers, versions):
            if version != self._weight_version:
                self._mark_restarted(server, f"weight version {version}, the others' is {self._weight_version}")
        return self._weight_version

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
        results = await self._call_each("/continue_generation", {})
        for server, result in zip(self.pool.servers, results, strict=True):
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
        await self.call_all("/begin_weight_update", {})

    async def end_weight_update(self) -> None:
        await self.call_all("/end_weight_update", {})

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
                try:
                    status, answer = await self._post(server.url, "/flush_cache", None, self.config.control_timeout_s)
                except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                    raise SGLangError(f"{server.url}/flush_cache: {exc!r}") from exc
                if status == 200:
                    return
                if status != 400 or asyncio.get_running_loop().time() >= deadline:
                    raise SGLangError(f"{server.url}/flush_cache answered {status} (for {wait:.0f}s): "
                                      f"{error_message(answer).strip()}")
                await asyncio.sleep(0.05)

        results = await asyncio.gather(*(one(s) for s in self.pool.servers), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise SGLangError("; ".join(str(e) for e in errors))

    def _mark_restarted(self, server: ServerState, why: str) -> None:
        """A server that serves another weight version restarted: stale until a sync updates it, and
        holding nothing released (a fresh process has all its memory)."""
        self.pool.mark_stale(server, why)
        self._released_on.pop(server.url, None)

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Free GPU memory (``weights``, ``kv_cache``, ``cuda_graph``; None: all) while paused.

        The servers must run with ``--enable-memory-saver`` (without it nothing is freed).
        """
        tags = tuple(MEMORY_TAGS if tags is None else tags)
        released = check_release(self.released_memory, tags, paused=self.paused)
        no_saver = [s.url for s, info in zip(self.pool.servers, await self.server_info())
                    if not info.get("enable_memory_saver")]
        if no_saver:
            raise SGLangError(f"{', '.join(no_saver)} run(s) without --enable-memory-saver: release frees nothing")
        await self.call_all("/release_memory_occupation", {"tags": list(tags)})
        self.released_memory = released
        for server in self.pool.servers:
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
        targets = [s for s in self.pool.servers if set(tags) <= set(self._released_on.get(s.url, ()))]
        skipped = [s.url for s in self.pool.servers if s not in targets]
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

        Rank 0 is the trainer; server i's TP ranks follow those of servers 0..i-1 (tp sizes
        from ``/server_info``). Fails at the first server that cannot join.
        """
        tp_sizes = [info["tp_size"] for info in await self.server_info()]
        offsets = [1 + sum(tp_sizes[:i]) for i in range(len(tp_sizes))]
        world_size = 1 + sum(tp_sizes)
        await self.call_all("/init_weights_update_group", fail_fast=True, payload_for=lambda i: {
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
        await self.call_all("/update_weights_from_distributed", payload)
        if version is not None:
            self._weight_version = version
            self.pool.mark_fresh()

    async def update_weights_from_tensor(self, payloads: Sequence[Sequence[str]], *, load_format: str | None = None,
                                         weight_version: str | None = None) -> None:
        """Colocated sync: ``payloads[i]`` is server i's list, one base64 MultiprocessingSerializer
        dump per TP rank (see ``megatron_tir.rollout.sync.sglang.serialize_for_tp_ranks``)."""
        tp_sizes = [info["tp_size"] for info in await self.server_info()]
        version = None if weight_version is None else parse_weight_version(weight_version, where="weight_version")
        if len(payloads) != len(tp_sizes):
            raise ValueError(f"update_weights_from_tensor: {len(payloads)} payload lists for {len(tp_sizes)} servers")
        for server, payload, tp in zip(self.pool.servers, payloads, tp_sizes):
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

        await self.call_all("/update_weights_from_tensor", payload_for=body)
        if version is not None:
            self._weight_version = version
            self.pool.mark_fresh()

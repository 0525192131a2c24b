"""SGLang servers behind the GenerationEngine interface (HTTP client; the servers run on GPUs).

One class, ``SGLangEngine``, whose methods are the servers' HTTP surface: generation, health and
the weight-version reads here; the control surface the weight sync calls (pause/resume, weight
updates, memory, flush, ``/server_info``) in :mod:`.control` (``SGLangControl``, mixed in); the
wire format in :mod:`.wire`, server choice in :mod:`.pool`. Endpoints, payloads and
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
    Each call is bounded by ``control_timeout_s`` (loads, joins, memory calls, pause), or, where
    SGLang answers without waiting for requests or a load (the session's begin and end,
    ``/continue_generation``, one ``/flush_cache`` try, the weight-version read), by
    ``quick_control_timeout_s``: a stuck server fails the sync within it.

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

    Before a sync, :meth:`SGLangEngine.wait_servers_back` waits ``rejoin_timeout_s`` for a
    server that does not answer while others do; then the sync goes on with the servers that
    answered (``sync_targets``: every control call of that sync goes to them only) and the late
    one is marked down and stale: it gets no work until a later sync, which finds it back,
    brings it to the current version. Only when no server answers does the sync wait longer,
    ``restart_timeout_s``: as long as loading the model and capturing CUDA graphs takes
    (:func:`load_wait_s` derives it from the checkpoint's size), then it fails naming them.

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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from megatron_tir.rollout.engines.base import (
    ContextTooLong,
    FinishReason,
    Generation,
    SamplingParams,
    bind_event_loop,
    check_generate_args,
)
from megatron_tir.rollout.engines.sglang.control import SGLangControl
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
# A server restart = process start + weight load + CUDA-graph capture (3-6 min at 32B). Loading reads the
# checkpoint from a shared filesystem that the other servers may be reading too (0.5 GB/s per server assumed);
# capturing the default batch sizes takes 1-2 min at 7B-32B. The wait is twice that sum, at least 5 min:
# Qwen2.5-32B in bf16 (65.5 GB) 8.4 min, Qwen2.5-7B (15.2 GB) 5.0 min.
LOAD_BYTES_PER_S = 0.5e9
CUDA_GRAPH_CAPTURE_S = 120.0
MIN_RESTART_WAIT_S = 300.0
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
    # one call SGLang answers without waiting for requests or a load (sglang 0.5.23: the tokenizer manager, or the
    # scheduler between two steps): begin/end of a weight-update session (paused: no lock taken; the weights
    # restored / post-processed in place, weight_updater.py), /continue_generation, one /flush_cache try (answered
    # at once without ?timeout, flush_wrapper.py), the weight-version read. /pause_generation stays on
    # control_timeout_s: in abort mode it waits until every request in flight let go of the model-update lock
    # (tokenizer_manager.py pause_generation)
    quick_control_timeout_s: float = 60.0
    health_check_interval_s: float = 5.0  # 0: none (a server marked down then stays down until check_health())
    health_timeout_s: float = 10.0  # > the ~1 s SGLang's /health sleeps before answering
    keepalive_timeout_s: float = 4.0  # idle connections are dropped before the server's 5 s
    max_attempts: int = 3  # servers tried per request (safe failures only)
    retry_backoff_s: float = 0.2
    max_route_keys: int = 100_000  # sticky-routing table size (see pool.py)
    # before a sync: how long a server that does not answer is waited for while others answer; then the
    # sync goes on without it (it gets no work until a later sync brings it to the current version)
    rejoin_timeout_s: float = 30.0
    # before a sync when no server answers (all restarting): as long as a load takes (see load_wait_s)
    restart_timeout_s: float = MIN_RESTART_WAIT_S

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
        for name in ("request_timeout_s", "connect_timeout_s", "control_timeout_s", "flush_timeout_s",
                     "quick_control_timeout_s", "rejoin_timeout_s", "restart_timeout_s"):
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


def load_wait_s(checkpoint_bytes: int) -> float:
    """How long a restarting server may take to answer again: twice (loading ``checkpoint_bytes``
    at ``LOAD_BYTES_PER_S`` + ``CUDA_GRAPH_CAPTURE_S``), at least ``MIN_RESTART_WAIT_S``."""
    if checkpoint_bytes < 0:
        raise ValueError(f"checkpoint_bytes must be >= 0, got {checkpoint_bytes}")
    return max(MIN_RESTART_WAIT_S, 2 * (checkpoint_bytes / LOAD_BYTES_PER_S + CUDA_GRAPH_CAPTURE_S))


def checkpoint_bytes(model_dir: str | Path) -> int:
    """Bytes of the weight files (``*.safetensors``, ``*.bin``, ``*.pt``) in an HF directory: what a server loads."""
    return sum(f.stat().st_size for f in Path(model_dir).iterdir()
               if f.is_file() and f.suffix in (".safetensors", ".bin", ".pt"))


class SGLangEngine(SGLangControl):
    """GenerationEngine over one or more SGLang servers (see the module docstring).

    ``async with SGLangEngine(SGLangEngineConfig(server_urls=(...), eos_token_ids=(...))) as e:``
    """

    def __init__(self, config: SGLangEngineConfig) -> None:
        self.config = config
        self.eos_token_ids: tuple[int, ...] = config.eos_token_ids
        self.pool = ServerPool(config.server_urls, max_keys=config.max_route_keys)
        # the servers the current weight sync addresses (wait_servers_back sets it; all until then)
        self.sync_targets: list[ServerState] = list(self.pool.servers)
        self.paused = False  # between pause() and resume(): health checks are suspended
        self.released_memory: tuple[str, ...] = ()  # tags released on every server, not yet resumed
        self._released_on: dict[str, tuple[str, ...]] = {}  # per server URL: what it holds released
        self._server_info: dict[str, dict[str, Any]] = {}  # per server URL: its /server_info
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
            if status != 200:  # the request's own fault (a prompt longer than the context: a data error)
                refused = ContextTooLong if "context length" in error_message(body).lower() else ValueError
                raise refused(f"SGLang {server.url} rejected the request ({status}): {error_message(body)}")
            gen = parse_generate_response(body, prompt_tokens=len(prompt), eos_token_ids=self.eos_token_ids,
                                          server=server.url, routed_experts_from=params.routed_experts_from)
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

    # ------------------------------------------------------------------ weight versions (restarts)

    async def _get_json(self, server: ServerState, endpoint: str, timeout) -> dict[str, Any]:
        """``GET server.url + endpoint`` as a JSON object; SGLangError naming the server otherwise."""
        try:
            async with self._session.get(f"{server.url}{endpoint}", timeout=timeout) as response:
                status, text = response.status, await response.text()
        except TimeoutError as exc:
            raise SGLangError(f"{server.url}{endpoint}: no answer within {timeout.total:g} s") from exc
        except (aiohttp.ClientError, OSError) as exc:
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

    async def wait_servers_back(self, timeout_s: float | None = None, *, restart_timeout_s: float | None = None,
                                poll_s: float = 0.2) -> list[ServerState]:
        """Before a sync: which servers take part (see the module docstring, Restarts).

        Polls ``/model_info`` of every server until all answered, or ``timeout_s`` (default: the
        config's ``rejoin_timeout_s``) passed and at least one did, or ``restart_timeout_s``
        (the config's by default) passed and none did (SGLangError naming them). Sets
        ``sync_targets`` to the servers that answered; each that did not is marked down and stale
        (no work until a sync reaches it). Returns the answering servers whose version is not the
        engine's (restarted), marked stale."""
        await self.start()
        wait = self.config.rejoin_timeout_s if timeout_s is None else timeout_s
        wait_all = max(wait, self.config.restart_timeout_s if restart_timeout_s is None else restart_timeout_s)
        loop = asyncio.get_running_loop()
        started = loop.time()
        answered: dict[str, int] = {}
        errors: dict[str, str] = {}
        while len(answered) < len(self.pool.servers):
            left = started + (wait if answered else wait_all) - loop.time()
            if left <= 0:
                break
            waiting = [s for s in self.pool.servers if s.url not in answered]
            call_s = max(min(left, self.config.health_timeout_s), 0.05)
            results = await asyncio.gather(*(asyncio.wait_for(self.server_weight_version(s, call_s), call_s)
                                             for s in waiting), return_exceptions=True)
            for server, result in zip(waiting, results):
                if isinstance(result, (SGLangError, TimeoutError)):
                    errors[server.url] = str(result) or type(result).__name__
                elif isinstance(result, BaseException):
                    raise result
                else:
                    answered[server.url] = result
            if len(answered) < len(self.pool.servers):
                await asyncio.sleep(min(poll_s, max(started + (wait if answered else wait_all) - loop.time(), 0)))
        if not answered:
            raise SGLangError(f"no SGLang server answered within {wait_all:g}s, so the weight sync cannot run: "
                              + "; ".join(f"{u}: {e}" for u, e in errors.items()))
        self.sync_targets = [s for s in self.pool.servers if s.url in answered]
        for server in self.pool.servers:
            if server.url not in answered:
                why = f"did not answer within {wait:g}s before a weight sync ({errors.get(server.url)})"
                self.pool.mark_down(server, why)
                self.pool.mark_stale(server, "it missed a weight sync")
        if len(self.sync_targets) < len(self.pool.servers):
            log.warning("weight sync goes on with %d of %d servers; %s get(s) no work until a sync reaches them",
                        len(self.sync_targets), len(self.pool.servers),
                        ", ".join(s.url for s in self.pool.servers if s.url not in answered))
        behind = []
        for server in self.sync_targets:
            version = answered[server.url]
            if version != self._weight_version:
                self._mark_restarted(server, f"weight version {version}, the engine's is {self._weight_version}")
                behind.append(server)
        return behind

    async def fetch_weight_version(self) -> int:
        """``GET /model_info`` of every server; records and returns their (highest) weight version.

        SGLang 0.5.23 reports the live version there (``/server_info`` holds the launch value).
        """
        await self.start()
        versions = await asyncio.gather(*(self.server_weight_version(s, self.config.quick_control_timeout_s)
                                          for s in self.pool.servers))
        if len(set(versions)) > 1:
            log.warning("SGLang servers hold different weight versions %s; the next sync aligns them",
                        dict(zip((s.url for s in self.pool.servers), versions)))
        self._weight_version = max(versions)
        self.sync_targets = list(self.pool.servers)  # every server answered
        for server, version in zip(self.pool.servers, versions):
            if version != self._weight_version:
                self._mark_restarted(server, f"weight version {version}, the others' is {self._weight_version}")
        return self._weight_version

    def _mark_restarted(self, server: ServerState, why: str) -> None:
        """A server that serves another weight version restarted: stale until a sync updates it, and
        holding nothing released (a fresh process has all its memory)."""
        self.pool.mark_stale(server, why)
        self._released_on.pop(server.url, None)

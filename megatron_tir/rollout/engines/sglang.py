"""SGLang servers behind the GenerationEngine interface (HTTP client; the servers run on GPUs).

Requests (SGLang 0.5.x native API, ``sglang/srt/entrypoints/http_server.py``):
    ``POST /generate`` with ``input_ids``, ``sampling_params`` (``max_new_tokens``,
    ``temperature``, ``top_p``, ``top_k``, ``stop``, ``no_stop_trim: true``,
    ``skip_special_tokens: false``, ``sampling_seed``), ``return_logprob: true`` and a
    ``rid``. (SGLang honors ``sampling_seed`` only on servers started with
    ``--enable-deterministic-inference``; otherwise seeded requests are not reproducible.) The answer's ``output_ids`` are the sampled ids, ``meta_info.
    output_token_logprobs`` holds ``[logprob, token_id, text|null]`` per id, and
    ``meta_info.finish_reason`` is ``{"type": "stop", "matched": str|int}`` (an int is
    the EOS id that ended it), ``{"type": "length", ...}`` or ``{"type": "abort", ...}``.
    SGLang's default sampler returns ``log(softmax(logits / T))`` of the sampled token
    before top-k / top-p (greedy: at T = 1) -- the same convention as the local engine.

Routing and failures
    Each request goes to the healthy server with the fewest requests in flight. It is
    retried on another server only when that is safe: the connection was refused (the
    request never reached a server) or the server answered 5xx without a result. A
    connection lost after the request was sent is not retried (the server may still be
    generating); it returns an ABORT generation with ``meta["error"]``. A 4xx answer
    raises ValueError (the request is wrong), an answer that breaks the schema raises
    :class:`SGLangError`. A background task polls ``GET /health`` and brings servers
    back when they answer 200.

Weight sync (all servers; endpoint and field names from SGLang's ``io_struct.py``):
    ``/init_weights_update_group`` + ``/update_weights_from_distributed`` (NCCL broadcast
    from the trainer, see :class:`DistributedWeightSync`), ``/update_weights_from_tensor``
    (colocated, serialized CUDA IPC handles), ``/flush_cache``,
    ``/release_memory_occupation``, ``/resume_memory_occupation``, ``/pause_generation``,
    ``/continue_generation``, ``/abort_request``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from megatron_tir.rollout.engines.base import FinishReason, Generation, SamplingParams

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")


class SGLangError(RuntimeError):
    """An SGLang server answered something unusable, or no server could take the request."""


@dataclass(kw_only=True, slots=True)
class SGLangEngineConfig:
    """Where the servers are and how to talk to them."""

    server_urls: tuple[str, ...]  # e.g. ("http://10.0.0.5:30000",)
    eos_token_ids: tuple[int, ...]  # see megatron_tir.rollout.engines.eos.resolve_eos_token_ids
    tp_size: int = 1  # GPUs per server: rank offsets of the weight-update group
    request_timeout_s: float = 3600.0  # one /generate call
    connect_timeout_s: float = 10.0
    control_timeout_s: float = 600.0  # weight sync, flush, pause, memory calls
    health_check_interval_s: float = 5.0  # 0: none (a server marked down then stays down until check_health())
    health_timeout_s: float = 5.0
    max_attempts: int = 3  # servers tried per request (safe failures only)
    retry_backoff_s: float = 0.2

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
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        for name in ("request_timeout_s", "connect_timeout_s", "control_timeout_s", "health_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.health_check_interval_s < 0:
            raise ValueError(f"health_check_interval_s must be >= 0, got {self.health_check_interval_s}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.retry_backoff_s < 0:
            raise ValueError(f"retry_backoff_s must be >= 0, got {self.retry_backoff_s}")


# ---------------------------------------------------------------------- wire format


def build_generate_request(prompt_ids: Sequence[int], params: SamplingParams, *, rid: str) -> dict[str, Any]:
    """The JSON body of ``POST /generate`` for one prompt."""
    sampling: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "no_stop_trim": True,  # keep the stop string's tokens: the trainer trains what was sampled
        "skip_special_tokens": False,
    }
    if params.stop:
        sampling["stop"] = list(params.stop)
    if params.seed is not None:
        sampling["sampling_seed"] = params.seed
    return {"rid": rid, "input_ids": [int(t) for t in prompt_ids], "sampling_params": sampling,
            "return_logprob": True}


def parse_generate_response(body: Any, *, prompt_tokens: int, eos_token_ids: Iterable[int],
                            server: str = "") -> Generation:
    """A ``/generate`` JSON answer -> Generation; SGLangError naming the broken field otherwise."""
    where = f"SGLang {server} /generate" if server else "SGLang /generate"

    def bad(what: str) -> SGLangError:
        return SGLangError(f"{where}: {what}")

    if not isinstance(body, dict):
        raise bad(f"expected a JSON object, got {type(body).__name__}")
    meta = body.get("meta_info")
    if not isinstance(meta, dict):
        raise bad("no meta_info object")
    entries = meta.get("output_token_logprobs")
    if not isinstance(entries, list):
        raise bad("meta_info.output_token_logprobs missing (was return_logprob dropped?)")
    logprobs, logprob_ids = [], []
    for i, entry in enumerate(entries):
        if not (isinstance(entry, list) and len(entry) == 3):
            raise bad(f"output_token_logprobs[{i}] is not [logprob, token_id, text]: {entry!r}")
        logprob, token_id = entry[0], entry[1]
        if isinstance(logprob, bool) or not isinstance(logprob, (int, float)) or math.isnan(logprob):
            raise bad(f"output_token_logprobs[{i}] has no log-prob: {entry!r}")
        if isinstance(token_id, bool) or not isinstance(token_id, int):
            raise bad(f"output_token_logprobs[{i}] has a non-integer token id: {entry!r}")
        logprobs.append(float(logprob))
        logprob_ids.append(token_id)
    output_ids = body.get("output_ids", logprob_ids)
    if not (isinstance(output_ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in output_ids)):
        raise bad(f"output_ids is not a list of token ids: {output_ids!r}")
    if output_ids != logprob_ids:
        raise bad(f"output_ids ({len(output_ids)}) and output_token_logprobs ({len(logprob_ids)}) disagree")

    reason = meta.get("finish_reason")
    if not isinstance(reason, dict) or not isinstance(reason.get("type"), str):
        raise bad(f"meta_info.finish_reason is not an object with a type: {reason!r}")
    kind, matched_stop, extra = reason["type"], None, {}
    if kind == "stop":
        matched = reason.get("matched")
        if isinstance(matched, str):
            finish, matched_stop = FinishReason.STOP, matched
        elif isinstance(matched, int) and not isinstance(matched, bool):
            finish = FinishReason.EOS
            if matched not in set(eos_token_ids):
                extra["matched_token_id"] = matched  # a stop token the server knows as EOS
        elif isinstance(matched, list) and matched and all(isinstance(t, int) for t in matched):
            finish, extra["matched_token_ids"] = FinishReason.EOS, matched
        else:
            raise bad(f"finish_reason stop has no usable 'matched': {reason!r}")
    elif kind == "length":
        finish = FinishReason.LENGTH
    elif kind == "abort":
        finish = FinishReason.ABORT
        extra["abort_message"] = reason.get("message")
    else:
        raise bad(f"unknown finish_reason type {kind!r}")

    meta_out: dict[str, Any] = {"server": server, **extra}
    for key in ("weight_version", "cached_tokens", "e2e_latency", "id"):
        if meta.get(key) is not None:
            meta_out[key] = meta[key]
    if isinstance(meta.get("prompt_tokens"), int) and meta["prompt_tokens"] != prompt_tokens:
        raise bad(f"prompt_tokens {meta['prompt_tokens']} != the {prompt_tokens} ids sent")
    return Generation(token_ids=list(output_ids), logprobs=logprobs, finish_reason=finish,
                      matched_stop=matched_stop, prompt_tokens=prompt_tokens, meta=meta_out)


def error_message(body: Any) -> str:
    """The human part of an SGLang error answer ({"error": {"message"}}, {"detail"}, or text)."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if err:
            return str(err)
        if body.get("detail"):
            return str(body["detail"])
        if body.get("message"):
            return str(body["message"])
    return str(body)[:500]


# ---------------------------------------------------------------------- server pool


@dataclass(slots=True, eq=False)
class ServerState:
    url: str
    healthy: bool = True
    in_flight: int = 0
    last_error: str | None = None


class ServerPool:
    """Least-in-flight choice among healthy servers (ties: round robin)."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.servers = [ServerState(url=u) for u in urls]
        self._turn = itertools.count()

    def pick(self, exclude: Sequence[ServerState] = ()) -> ServerState | None:
        candidates = [s for s in self.servers if s.healthy and s not in exclude]
        if not candidates:
            return None
        least = min(s.in_flight for s in candidates)
        tied = [s for s in candidates if s.in_flight == least]
        return tied[next(self._turn) % len(tied)]

    def mark_down(self, server: ServerState, why: str) -> None:
        if server.healthy:
            log.warning("SGLang server %s marked unhealthy: %s", server.url, why)
        server.healthy, server.last_error = False, why

    def mark_up(self, server: ServerState) -> None:
        if not server.healthy:
            log.info("SGLang server %s is healthy again", server.url)
        server.healthy, server.last_error = True, None


# ---------------------------------------------------------------------- the engine


class SGLangEngine:
    """GenerationEngine over one or more SGLang servers (see the module docstring).

    ``async with SGLangEngine(SGLangEngineConfig(server_urls=(...), eos_token_ids=(...))) as e:``
    """

    def __init__(self, config: SGLangEngineConfig) -> None:
        self.config = config
        self.eos_token_ids: tuple[int, ...] = config.eos_token_ids
        self.pool = ServerPool(config.server_urls)
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._health_task: asyncio.Task | None = None
        self._admitting: asyncio.Event | None = None
        self._weight_sync: DistributedWeightSync | None = None
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Open the HTTP session and start health checks (``generate`` does this on first use)."""
        if self._closed:
            raise RuntimeError("SGLangEngine is closed")
        if self._session is not None:
            if self._loop is not asyncio.get_running_loop():
                raise RuntimeError("SGLangEngine is bound to the event loop that first used it; create one per loop")
            return
        self._loop = asyncio.get_running_loop()
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s),
            connector=aiohttp.TCPConnector(limit=0),  # many long generations in flight
        )
        self._admitting = asyncio.Event()
        self._admitting.set()
        if self.config.health_check_interval_s > 0:
            self._health_task = asyncio.get_running_loop().create_task(self._health_loop(), name="sglang-health")

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
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            ok, why = False, f"/health failed: {exc!r}"
        if ok:
            self.pool.mark_up(server)
        else:
            self.pool.mark_down(server, why)
        return ok

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_check_interval_s)
            await asyncio.gather(*(self._check_one(s) for s in self.pool.servers))

    # ------------------------------------------------------------------ generate

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if isinstance(prompt_ids, (str, bytes)):
            raise ValueError("prompt_ids must be token ids, not text")
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids is empty")
        if min(prompt) < 0:
            raise ValueError(f"prompt_ids has negative ids: {[t for t in prompt if t < 0][:5]}")
        await self.start()
        await self._admitting.wait()
        rid = uuid.uuid4().hex
        payload = build_generate_request(prompt, params, rid=rid)
        tried: list[ServerState] = []
        failures: list[str] = []
        for attempt in range(self.config.max_attempts):
            server = self.pool.pick(exclude=tried)
            if server is None:
                break
            tried.append(server)
            server.in_flight += 1
            try:
                status, body = await self._post(server.url, "/generate", payload, self.config.request_timeout_s)
            except aiohttp.ClientConnectorError as exc:  # never reached the server: safe to retry
                self.pool.mark_down(server, f"connect failed: {exc}")
                failures.append(f"{server.url}: connect failed ({exc.os_error})")
                await asyncio.sleep(self.config.retry_backoff_s * attempt)
                continue
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:  # sent, then lost: not retried
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
            return parse_generate_response(body, prompt_tokens=len(prompt), eos_token_ids=self.eos_token_ids,
                                           server=server.url)
        if not failures:
            down = ", ".join(f"{s.url} ({s.last_error})" for s in self.pool.servers)
            raise SGLangError(f"no healthy SGLang server: {down}")
        raise SGLangError(f"/generate failed on {len(failures)} server(s): {'; '.join(failures)}")

    def _abort_on_server(self, url: str, rid: str) -> None:
        """Best effort: tell the server to stop a request whose caller went away."""
        async def abort() -> None:
            try:
                await self._post(url, "/abort_request", {"rid": rid}, self.config.health_timeout_s)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
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
                       payload_for: Callable[[int], dict[str, Any]] | None = None) -> list[Any]:
        """POST ``path`` to every server at once; SGLangError listing each server that failed.

        ``payload_for(i)`` gives server i its own payload (e.g. its rank offset).
        """
        await self.start()

        async def one(i: int, server: ServerState) -> Any:
            body = payload_for(i) if payload_for is not None else (payload or {})
            try:
                status, answer = await self._post(server.url, path, body, self.config.control_timeout_s)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                raise SGLangError(f"{server.url}{path}: {exc!r}") from exc
            success = answer.get("success", True) if isinstance(answer, dict) else True
            if status != 200 or success is False:
                raise SGLangError(f"{server.url}{path} answered {status}: {error_message(answer)}")
            return answer

        results = await asyncio.gather(*(one(i, s) for i, s in enumerate(self.pool.servers)),
                                       return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise SGLangError("; ".join(str(e) for e in errors))
        return results

    async def pause(self, *, mode: str = "abort") -> None:
        """Stop admitting requests here and ``/pause_generation`` on every server.

        ``abort``: running requests return ABORT with their partial output; ``retract`` /
        ``in_place``: they wait on the server and continue after ``resume``.
        """
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        await self.start()
        self._admitting.clear()
        await self.call_all("/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self.start()
        await self.call_all("/continue_generation", {})
        self._admitting.set()

    async def flush_cache(self) -> None:
        """Drop the radix (prefix) cache; SGLang refuses while requests are running."""
        await self.call_all("/flush_cache")

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Free GPU memory (``weights`` / ``kv_cache``; servers need ``--enable-memory-saver``)."""
        await self.call_all("/release_memory_occupation", {"tags": list(tags) if tags is not None else None})

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        await self.call_all("/resume_memory_occupation", {"tags": list(tags) if tags is not None else None})

    async def init_weights_update_group(self, *, master_address: str, master_port: int, group_name: str,
                                        backend: str = "nccl") -> int:
        """Ask every server to join the trainer's broadcast group; returns its world size.

        Rank 0 is the trainer; server i's TP ranks are ``1 + i * tp_size ...``.
        """
        world_size = 1 + len(self.pool.servers) * self.config.tp_size
        await self.call_all("/init_weights_update_group", payload_for=lambda i: {
            "master_address": master_address, "master_port": int(master_port),
            "rank_offset": 1 + i * self.config.tp_size, "world_size": world_size,
            "group_name": group_name, "backend": backend,
        })
        return world_size

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self.call_all("/destroy_weights_update_group", {"group_name": group_name})

    async def update_weights_from_distributed(self, *, names: Sequence[str], dtypes: Sequence[str],
                                              shapes: Sequence[Sequence[int]], group_name: str,
                                              flush_cache: bool = False, weight_version: str | None = None) -> None:
        """Announce one bucket of tensors; the trainer broadcasts them (rank 0) meanwhile."""
        payload = {"names": list(names), "dtypes": list(dtypes), "shapes": [list(map(int, s)) for s in shapes],
                   "group_name": group_name, "flush_cache": flush_cache}
        if weight_version is not None:
            payload["weight_version"] = weight_version
        await self.call_all("/update_weights_from_distributed", payload)

    async def update_weights_from_tensor(self, serialized_named_tensors: Sequence[str], *, flush_cache: bool = True,
                                         load_format: str | None = None, weight_version: str | None = None) -> None:
        """Colocated sync: base64 of SGLang's MultiprocessingSerializer output, one entry per TP rank."""
        payload: dict[str, Any] = {"serialized_named_tensors": list(serialized_named_tensors),
                                   "flush_cache": flush_cache}
        if load_format is not None:
            payload["load_format"] = load_format
        if weight_version is not None:
            payload["weight_version"] = weight_version
        await self.call_all("/update_weights_from_tensor", payload)

    def attach_weight_sync(self, sync: DistributedWeightSync) -> None:
        """Make ``update_weights`` broadcast through ``sync`` (see DistributedWeightSync)."""
        self._weight_sync = sync

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        sync = self._weight_sync
        if sync is None:
            raise RuntimeError("SGLangEngine.update_weights needs a weight sync: call attach_weight_sync(...) first")
        await sync.update_weights(self, named_tensors)


# ---------------------------------------------------------------------- trainer-side broadcast


@dataclass(kw_only=True, slots=True)
class DistributedWeightSyncConfig:
    master_address: str  # this trainer rank's address, reachable from the servers
    master_port: int
    group_name: str = "megatron_tir_weights"
    backend: str = "nccl"  # gloo works on CPU (tests)
    bucket_bytes: int = 512 << 20  # tensors announced per /update_weights_from_distributed call
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.master_address:
            raise ValueError("master_address is empty")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be in 1..65535, got {self.master_port}")
        if not self.group_name:
            raise ValueError("group_name is empty")
        if self.backend not in ("nccl", "gloo"):
            raise ValueError(f"backend must be nccl or gloo, got {self.backend!r}")
        if self.bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {self.bucket_bytes}")


def new_trainer_process_group(*, master_address: str, master_port: int, world_size: int, group_name: str,
                              backend: str, timeout_s: float):
    """Rank 0 of a process group outside the trainer's default world, joined by the servers.

    SGLang's servers build their side with a TCP rendezvous at ``master_address:port``,
    a ``PrefixStore(group_name, store)`` and ``_new_process_group_helper`` (sglang
    ``init_custom_process_group``); the trainer side must build the same store layout.
    """
    from datetime import timedelta

    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=timeout_s)
    store, rank, world = next(c10d.rendezvous(f"tcp://{master_address}:{master_port}", 0, world_size,
                                              timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    pg, _ = c10d._new_process_group_helper(world, rank, [], c10d.Backend(backend), store, group_name=group_name,
                                           backend_options=None, timeout=timeout)
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world)}
    return pg


class DistributedWeightSync:
    """Trainer rank 0 broadcasts HF-named tensors to every server's TP ranks.

    ``connect(engine)`` creates the group (servers join via /init_weights_update_group);
    ``update_weights`` announces each bucket's names/dtypes/shapes to all servers and
    broadcasts the tensors in the same order, then flushes the prefix cache.
    """

    def __init__(self, config: DistributedWeightSyncConfig) -> None:
        self.config = config
        self.group = None
        self.version = 0

    async def connect(self, engine: SGLangEngine) -> None:
        cfg = self.config
        world_size = 1 + len(engine.pool.servers) * engine.config.tp_size
        group_task = asyncio.get_running_loop().run_in_executor(None, lambda: new_trainer_process_group(
            master_address=cfg.master_address, master_port=cfg.master_port, world_size=world_size,
            group_name=cfg.group_name, backend=cfg.backend, timeout_s=cfg.timeout_s))
        try:
            await engine.init_weights_update_group(master_address=cfg.master_address, master_port=cfg.master_port,
                                                   group_name=cfg.group_name, backend=cfg.backend)
        finally:
            self.group = await group_task
        engine.attach_weight_sync(self)
        log.info("weight-update group %s ready (world size %d)", cfg.group_name, world_size)

    async def update_weights(self, engine: SGLangEngine, named_tensors: Iterable[tuple[str, Any]]) -> None:
        import torch
        import torch.distributed as dist

        if self.group is None:
            raise RuntimeError("DistributedWeightSync.connect(engine) was not called")
        self.version += 1
        loop = asyncio.get_running_loop()
        for bucket in _buckets(named_tensors, self.config.bucket_bytes):
            for name, tensor in bucket:
                if not isinstance(tensor, torch.Tensor):
                    raise ValueError(f"update_weights: {name} is a {type(tensor).__name__}, not a torch.Tensor")
            announce = loop.create_task(engine.update_weights_from_distributed(
                names=[n for n, _ in bucket], dtypes=[str(t.dtype).removeprefix("torch.") for _, t in bucket],
                shapes=[list(t.shape) for _, t in bucket], group_name=self.config.group_name,
                weight_version=str(self.version)))

            def send(bucket=bucket) -> None:
                for _, tensor in bucket:
                    dist.broadcast(tensor.contiguous(), src=0, group=self.group)

            try:
                await loop.run_in_executor(None, send)
            finally:
                await announce
        await engine.flush_cache()


def _buckets(named_tensors: Iterable[tuple[str, Any]], limit: int):
    bucket, size = [], 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size() if hasattr(tensor, "element_size") else 0
        if bucket and size + nbytes > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket

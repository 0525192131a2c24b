"""A stand-in SGLang 0.5.23 HTTP server that behaves like the real one (a real server needs a GPU).

Schema: every body is checked with the installed SGLang sources (see sglang_schema.py);
answers are api_types structs encoded with their ``to_json_value``. Generation is real:
the backend is a LocalEngine over a tiny HF model (fake_sglang_backend.py). Run as a script
it is a server process the launcher can start (``python fake_sglang.py --model-path DIR
--port N ...``).

Behaviour held to sglang 0.5.23 (file names under ``sglang/srt/``):
  1. weight-update session -- ``/update_weights_from_distributed`` and
     ``/update_weights_from_tensor`` answer 400 ``success: false`` outside
     ``/begin_weight_update`` .. ``/end_weight_update``; a second begin, or an end without
     begin, is refused (``managers/scheduler_components/weight_updater.py``). An update
     with ``flush_cache`` (the default) fails when requests are still running or queued.
  2. EOS -- the server stops on its model's EOS ids and the request's
     ``sampling_params.stop_token_ids`` only (``managers/schedule_batch.py``
     ``_check_token_based_finish``; ``configs/model_config.py``); ``finish_reason`` is
     ``{"type": "stop", "matched": <id>}``.
  3. health -- ``/health`` is a generation probe: it sleeps 1 s, answers 200 when the probe
     came back, and waits while generation is paused (``HEALTH_CHECK_TIMEOUT`` 20 s, then
     503); with ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0`` it answers 200 at once
     (``entrypoints/http_server.py``, ``environ.py``). New ``/generate`` requests wait while
     paused (``managers/tokenizer_manager.py``).
  4. memory -- release asserts an idle scheduler (waiting requests ignored while the
     scheduler is paused); resume with no tags resumes all tags and a tag not released
     raises (``offload_tags.remove``); either failure kills the scheduler, and with it the
     server (``managers/scheduler.py`` sends SIGQUIT). Without ``--enable-memory-saver``
     nothing is freed (``utils/torch_memory_saver_adapter.py``). With it, the memory saver
     unmaps the pages of a released tag: a weight load while ``weights`` is released, or a
     forward pass (a ``/generate`` reaching the scheduler) while any tag is released, writes
     into unmapped memory -- a CUDA illegal-address error that kills the scheduler
     (``managers/scheduler_components/weight_updater.py`` resumes ``weights`` before a load
     can use them; a colocated trainer resumes weights, loads, then kv_cache + cuda_graph).
  5. flush -- ``/flush_cache`` answers 400 unless the scheduler is idle (a paused scheduler
     ignores its waiting queue); right after an abort the scheduler still holds the batch
     for ``abort_drain_s``. ``?timeout=S`` waits for a fully idle scheduler (waiting queue
     included) up to S (``managers/scheduler_components/flush_wrapper.py``).
  7. keep-alive -- idle connections are closed after 5 s (uvicorn ``timeout_keep_alive`` =
     ``SGLANG_TIMEOUT_KEEP_ALIVE``).
  8. process group -- ``/server_info`` reports ``tp_size`` and ``dp_size``; the weight
     endpoints assert ``dp_size == 1`` (an AssertionError: HTTP 500); a join that cannot
     succeed answers 400 ``Failed to initialize custom process group: ...``; IPv6 master
     addresses are bracketed (``utils/network.py`` ``NetworkAddress.to_tcp``).
  9. weight version -- ``"default"`` at launch (``arg_groups/fields/serving.py``); an update
     with ``weight_version`` adopts it on success (``managers/tokenizer_control_mixin.py``)
     and marks it for requests in flight (``managers/scheduler.py``
     ``record_weight_version_change``). ``GET /model_info`` reports the live version,
     ``/server_info`` the launch value (its docstring, ``entrypoints/http_server.py``). Every
     ``/generate`` answer carries ``meta_info.weight_versions`` spans covering all output
     tokens and ``meta_info.weight_version`` = the last span's version
     (``utils/weight_versions.py`` ``compute_weight_version_spans``,
     ``add_weight_versions_to_meta_info``); there is no ``/get_weight_version`` in 0.5.23.
  10. several groups, one request at a time -- groups are kept by name, any number of them
     (``model_executor/model_runner_components/weight_updater.py`` ``_model_update_group``);
     the scheduler runs one request at a time and a join or a receive holds it until every
     rank of that group is there (``managers/scheduler.py`` event loop), so group joins,
     receives and leaves here take one lock: a trainer that sends two groups' requests to two
     servers in different orders deadlocks them, as it would the real ones.
  11. bucket formats -- ``load_format: "flattened_bucket"`` receives one uint8 broadcast laid
     out by SGLang's own ``FlattenedTensorBucket`` (``weight_sync/tensor_bucket.py``, loaded from
     the installed source); any other value receives one broadcast per tensor, as
     ``receive_weights_from_distributed`` does. ``/fake_state`` lists what arrived on which group
     (``received``) and, with ``?weights=1``, a sha256 of every served weight. The flattened
     receive buffer is SGLang's ``FlattenedTensorBucket`` over memory kept between receives: the
     real one allocates it with ``torch.empty(..., device=self.device)`` on the GPU
     (``_receive_bucketed_weights_from_distributed``), where CUDA's caching allocator hands back a
     block freed by the previous bucket; a fresh CPU allocation would instead fault in every page
     of every bucket (~17 ms per 50 MB here), a cost the real server does not pay.
  12. routed experts -- ``return_routed_experts`` / ``routed_experts_start_len`` as the scheduler
     admits them and ``meta_info.routed_experts`` only with ``--enable-return-routed-experts``
     (``fake_sglang_routing.py`` says which sglang files).
Prefix cache: ``meta_info.cached_tokens`` comes from a radix-cache model (a token trie of
every finished request's prompt + output, at most ``len(input_ids) - 1`` matched, reset by
a flush), so routing policies can be measured.

One fake server, run as a process by the tests; each rule sits beside the endpoint it guards with
the sglang file it follows. The weight-update endpoints (rules 1, 8-11) are in fake_sglang_weights.py.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from fake_sglang_routing import routed_experts_b64, start_len_problem
from fake_sglang_weights import WeightUpdateEndpoints, _json, tcp_address  # noqa: F401 - tcp_address: the tests'
from sglang_schema import (
    api_types,
    check_io_struct,
    server_cli_flags,
)

log = logging.getLogger("fake_sglang")

DROP_CONNECTION = object()  # a /generate handler returns this to cut the connection without an answer
GenerateHandler = Callable[[Any, dict], Awaitable[Any]]  # (GenerateRequest, raw body) -> struct | (status, dict)
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # srt/constants.py GPU_MEMORY_ALL_TYPES
KEEPALIVE_S = 5.0  # srt/environ.py SGLANG_TIMEOUT_KEEP_ALIVE
LAUNCH_WEIGHT_VERSION = "default"  # srt/arg_groups/fields/serving.py weight_version
HEALTH_CHECK_TIMEOUT_S = 20.0  # srt/entrypoints/http_server.py HEALTH_CHECK_TIMEOUT

_CONTROL = {  # POST path -> io_struct request class
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/abort_request": "AbortReq",
}
_DP_ASSERTED = ("/init_weights_update_group", "/destroy_weights_update_group", "/update_weights_from_distributed",
                "/update_weights_from_tensor")


class RadixCache:
    """Prefix-cache model: a token trie of finished sequences (no eviction)."""

    def __init__(self) -> None:
        self.root: dict = {}

    def match(self, ids: list[int]) -> int:
        node, n = self.root, 0
        for token in ids[: max(len(ids) - 1, 0)]:  # at least one token is computed
            if token not in node:
                break
            node, n = node[token], n + 1
        return n

    def insert(self, ids: list[int]) -> None:
        node = self.root
        for token in ids:
            node = node.setdefault(token, {})

    def reset(self) -> None:
        self.root = {}


def torch_uint8():
    import torch

    return torch.uint8


class FakeSGLangServer(WeightUpdateEndpoints):
    """aiohttp app with SGLang's native endpoints; records every request and contract error."""

    def __init__(self, generate: GenerateHandler, *, engine=None, join_weight_groups: bool = False,
                 tp_size: int = 1, dp_size: int = 1, enable_memory_saver: bool = False,
                 health_generation: bool | None = None, init_failure: str | None = None,
                 join_wait_s: float = 0.0, abort_drain_s: float = 0.3) -> None:
        self.generate_handler = generate
        self.engine = engine  # LocalEngine behind /generate, for pause / weights
        self.join_weight_groups = join_weight_groups  # really join /init_weights_update_group (gloo; own process)
        self.tp_size, self.dp_size, self.enable_memory_saver = tp_size, dp_size, enable_memory_saver
        if health_generation is None:  # srt/environ.py EnvBool(True)
            health_generation = os.environ.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "1").lower() not in (
                "0", "false", "no", "off")
        self.health_generation = health_generation
        self.init_failure = init_failure  # a join that fails with this message
        self.join_wait_s = join_wait_s  # without joining: how long the join call takes (a real one waits for all ranks)
        self.abort_drain_s = abort_drain_s
        self.generate_delay_s = 0.0  # every /generate waits this long first (a large model's latency)
        self.enable_return_routed_experts = False  # --enable-return-routed-experts (fake_sglang_routing.py)
        self.receive_failure: str | None = None  # a receive that fails with this before the broadcast; "hang": never ends
        self.hang_paths: frozenset[str] = frozenset()  # control calls that never answer (a stuck scheduler)
        self.requests: list[tuple[str, Any]] = []
        self.contract_errors: list[str] = []
        self.healthy = True  # False: /health 503 at once (starting or shutting down)
        self.crashed: str | None = None  # the scheduler died: the server is gone
        self.is_pause = False  # tokenizer manager: new requests wait
        self.scheduler_pause: str | None = None  # "retract" | "in_place" (abort does not pause the scheduler)
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self.in_scheduler = 0  # requests admitted and not finished
        self.busy_until = 0.0  # after an abort the scheduler still holds the batch until then
        self.session_open = False
        self.flush_pending = False
        self.memory_released: set[str] = set()  # offload_tags
        self.memory_freed: set[str] = set()  # what the memory saver really freed
        self.groups: dict[str, Any] = {}  # weight-update groups joined (None when not really joined)
        self.scheduler_lock = asyncio.Lock()  # rule 10: one blocking scheduler request at a time
        self.received: list[dict] = []  # rule 11: per update, its group, format, names and bytes
        self._receive_buffer = [None]  # rule 11: the flattened receive memory, reused (the caching allocator's part)
        self.weight_version = LAUNCH_WEIGHT_VERSION
        self._version_names = {"0": "default"}  # backend LocalEngine version -> announced weight_version
        self.radix = RadixCache()
        self.cached_tokens: list[tuple[int, int]] = []  # (cached, prompt) per /generate
        self.runner: web.AppRunner | None = None
        self.url = ""
        app = web.Application(client_max_size=1 << 30, middlewares=[self._gone_when_crashed])
        app.router.add_get("/health", self._health)
        app.router.add_get("/server_info", self._server_info)
        app.router.add_get("/model_info", self._model_info)
        app.router.add_get("/fake_state", self._fake_state)  # the fake's own: what tests of a server process read
        app.router.add_route("*", "/flush_cache", self._flush_cache)
        app.router.add_post("/generate", self._generate)
        for path in _CONTROL:
            app.router.add_post(path, self._control)
        self.app = app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self.runner = web.AppRunner(self.app, access_log=None, keepalive_timeout=KEEPALIVE_S)
        await self.runner.setup()
        self._site = web.TCPSite(self.runner, host, port)
        await self._site.start()
        self.port = self._site._server.sockets[0].getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        return self.url

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    # ------------------------------------------------------------------ scheduler state

    def idle(self, *, ignore_waiting: bool) -> bool:
        """scheduler.is_fully_idle: retracted requests wait in the queue, others run."""
        if asyncio.get_running_loop().time() < self.busy_until:
            return False
        running = 0 if self.scheduler_pause == "retract" else self.in_scheduler
        waiting = self.in_scheduler - running
        return running == 0 and (ignore_waiting or waiting == 0)

    def crash(self, request: web.Request, why: str) -> web.Response:
        """The scheduler raised: SGLang's process tree exits (the request gets no answer)."""
        log.error("scheduler crashed: %s", why)
        self.crashed = why
        self._site._server.close()  # new connections are refused
        request.transport.abort()
        return web.Response(status=500)

    @web.middleware
    async def _gone_when_crashed(self, request: web.Request, handler):
        if self.crashed is not None:
            request.transport.abort()
            return web.Response(status=500)
        return await handler(request)

    def _reject(self, message: str) -> web.Response:
        self.contract_errors.append(message)
        return web.json_response({"error": {"message": message}}, status=400)

    # ------------------------------------------------------------------ endpoints

    async def _health(self, request: web.Request) -> web.Response:
        if not self.healthy:
            return web.Response(status=503)
        if not self.health_generation:
            return web.Response(status=200)
        loop = asyncio.get_running_loop()
        tic = loop.time()
        while loop.time() < tic + HEALTH_CHECK_TIMEOUT_S:
            await asyncio.sleep(1)
            if not self.is_pause:  # the one-token probe got through
                return web.Response(status=200)
        return web.Response(status=503)

    async def _server_info(self, request: web.Request) -> web.Response:
        self.requests.append(("/server_info", None))
        return _json({"tp_size": self.tp_size, "dp_size": self.dp_size, "enable_memory_saver": self.enable_memory_saver,
                      "weight_version": LAUNCH_WEIGHT_VERSION, "version": "0.5.23"})

    async def _model_info(self, request: web.Request) -> web.Response:
        self.requests.append(("/model_info", None))
        return _json({"model_path": "fake", "is_generation": True, "weight_version": self.weight_version})

    async def _fake_state(self, request: web.Request) -> web.Response:
        state = {"paths": [p for p, _ in self.requests], "session_open": self.session_open,
                 "is_pause": self.is_pause, "weight_version": self.weight_version,
                 "memory_released": sorted(self.memory_released), "contract_errors": self.contract_errors,
                 "received": self.received}
        if self.engine is not None:  # tokens sampled so far by each request the backend holds (tests wait on it)
            state["sampled"] = [len(r.token_ids) for r in list(self.engine._live)]
        if request.query.get("weights") and self.engine is not None:
            import hashlib

            state["weights"] = {name: hashlib.sha256(t.detach().contiguous().cpu().reshape(-1).view(torch_uint8())
                                                     .numpy().tobytes()).hexdigest()
                                for name, t in self.engine.model.state_dict().items()}
        return _json(state)

    async def _flush_cache(self, request: web.Request) -> web.Response:
        try:
            timeout = float(request.query.get("timeout", 0.0))
            assert timeout >= 0
        except (ValueError, AssertionError):
            return _json({"detail": [{"loc": ["query", "timeout"], "msg": "must be >= 0"}]}, status=422)
        self.requests.append(("/flush_cache", {"timeout": timeout}))
        if "/flush_cache" in self.hang_paths:  # a scheduler that never answers
            await asyncio.Event().wait()
        if self.flush_pending:
            return web.Response(text="Another flush_cache is already in progress.", status=400)
        ok = True
        if timeout <= 0:
            ok = self.idle(ignore_waiting=self.scheduler_pause is not None)
            message = "Flush cache failed.\n"
        else:
            self.flush_pending = True
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            try:
                while not self.idle(ignore_waiting=False):
                    if loop.time() >= deadline:
                        ok = False
                        break
                    await asyncio.sleep(0.01)
            finally:
                self.flush_pending = False
            message = "Timed out waiting for idle state."
        if not ok:
            return web.Response(text=message, status=400)
        self.radix.reset()
        return web.Response(text="Cache flushed.\n")

    async def _generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(("/generate", body))
        types = api_types()
        try:
            parsed = types.GenerateRequest.from_json_value(body)
        except types.JsonContractError as exc:
            return self._reject(f"/generate: {exc}")
        routed = body.get("return_routed_experts") is True  # io_struct.GenerateReqInput; the contract ignores it
        if routed and (problem := start_len_problem(parsed.routed_experts_start_len, len(parsed.input_ids))):
            return self._reject(problem)  # the scheduler's admission abort, a 400 (fake_sglang_routing.py)
        await self._unpaused.wait()
        if self.generate_delay_s:  # a large model's latency (the rehearsal's slow held-out evaluation)
            await asyncio.sleep(self.generate_delay_s)
        if self.memory_freed:
            return self.crash(request, f"CUDA error: an illegal memory access (a forward pass with "
                                       f"{sorted(self.memory_freed)} released)")
        cached = self.radix.match(list(parsed.input_ids))
        self.in_scheduler += 1
        try:
            answer = await self.generate_handler(parsed, body)
        finally:
            self.in_scheduler -= 1
        if answer is DROP_CONNECTION:  # the connection dies after the request arrived
            request.transport.abort()
            return web.Response(status=200)
        if isinstance(answer, tuple):  # (status, raw JSON): deliberate failures in tests
            status, raw = answer
            return web.json_response(raw, status=status)
        self.radix.insert(list(parsed.input_ids) + list(answer.output_ids or [])[:-1])
        self.cached_tokens.append((cached, len(parsed.input_ids)))
        if answer.meta_info is not None:
            import msgspec

            if self.engine is not None:  # the backend's versions, under the names the updates announced
                spans = [msgspec.structs.replace(s, version=self._version_names.get(s.version, s.version))
                         for s in answer.meta_info.weight_versions]
            else:  # a scripted backend: every token sampled by the version served now
                spans = [types.WeightVersionSpan(version=self.weight_version, start=0,
                                                 end=len(answer.output_ids or []))]
            answer = msgspec.structs.replace(answer, meta_info=msgspec.structs.replace(
                answer.meta_info, weight_version=spans[-1].version, weight_versions=spans, cached_tokens=cached))
        out = answer.to_json_value()
        if routed and self.enable_return_routed_experts and out.get("meta_info") is not None:
            out["meta_info"]["routed_experts"] = routed_experts_b64(self.engine.model, list(parsed.input_ids),
                                                                    list(answer.output_ids or []),
                                                                    parsed.routed_experts_start_len)
        return web.json_response(out)

    async def _control(self, request: web.Request) -> web.Response:
        path = request.path
        body = await request.json() if request.can_read_body else {}
        self.requests.append((path, body))
        log.info("POST %s", path)
        if problem := check_io_struct(_CONTROL[path], body):
            return self._reject(problem)
        if path in self.hang_paths:  # the tokenizer manager waits for a scheduler that never answers
            await asyncio.Event().wait()
        if path in _DP_ASSERTED and self.dp_size != 1:  # tokenizer_control_mixin.py: assert dp_size == 1
            return web.Response(text="Internal Server Error", status=500)
        return await getattr(self, "_do_" + path.strip("/"))(request, body)

    async def _do_abort_request(self, request, body: dict) -> web.Response:
        return web.Response(status=200)

    async def _do_pause_generation(self, request, body: dict) -> web.Response:
        from megatron_tir.rollout.engines.base import PauseMode

        mode = body.get("mode", "abort")
        self.is_pause = True
        self._unpaused.clear()
        if mode == "abort":
            self.busy_until = asyncio.get_running_loop().time() + self.abort_drain_s
        else:
            self.scheduler_pause = mode
        if self.engine is not None:
            await self.engine.pause(mode=PauseMode(mode))
        return _json({"message": "Generation paused successfully.", "status": "ok"})

    async def _do_continue_generation(self, request, body: dict) -> web.Response:
        self.is_pause, self.scheduler_pause = False, None
        if self.engine is not None:
            await self.engine.resume()
        self._unpaused.set()
        return _json({"message": "Generation continued successfully.", "status": "ok"})

    async def _do_release_memory_occupation(self, request, body: dict) -> web.Response:
        if not self.idle(ignore_waiting=self.scheduler_pause is not None):
            return self.crash(request, "release_memory_occupation should be called only when server is idle.")
        tags = body.get("tags") or list(MEMORY_TAGS)
        self.memory_released.update(tags)
        if self.enable_memory_saver:
            self.memory_freed.update(tags)
        return _json(None)

    async def _do_resume_memory_occupation(self, request, body: dict) -> web.Response:
        tags = body.get("tags") or list(MEMORY_TAGS)
        missing = [t for t in tags if t not in self.memory_released]
        if missing:
            return self.crash(request, f"KeyError: {missing[0]!r} (offload_tags.remove)")
        self.memory_released.difference_update(tags)
        self.memory_freed.difference_update(tags)
        return _json(None)


def main(argv: list[str] | None = None) -> int:
    """Server process: accepts only flags SGLang's launch_server declares."""
    argv = list(sys.argv[1:] if argv is None else argv)
    unknown = [a.split("=")[0] for a in argv if a.startswith("--") and a.split("=")[0] not in server_cli_flags()]
    if unknown:
        print(f"fake_sglang: SGLang has no flag(s) {unknown}", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--random-seed", type=int, default=0)
    parser.add_argument("--enable-memory-saver", action="store_true")
    parser.add_argument("--enable-return-routed-experts", action="store_true")
    args, _ = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s fake_sglang %(message)s")

    async def serve() -> None:
        from fake_sglang_backend import local_engine_handler

        from megatron_tir.rollout.engines.local import LocalEngine, LocalEngineConfig

        engine = LocalEngine(LocalEngineConfig(model=args.model_path, seed=args.random_seed, torch_threads=1))
        server = FakeSGLangServer(local_engine_handler(engine), engine=engine, join_weight_groups=True,
                                  enable_memory_saver=args.enable_memory_saver)
        # not an SGLang flag: the environment sets the stand-in's latency per request (the rehearsal)
        server.generate_delay_s = float(os.environ.get("FAKE_SGLANG_GENERATE_DELAY_S", "0"))
        server.enable_return_routed_experts = args.enable_return_routed_experts
        server.receive_failure = os.environ.get("FAKE_SGLANG_RECEIVE_FAILURE") or None  # the timeout tests
        server.init_failure = os.environ.get("FAKE_SGLANG_INIT_FAILURE") or None  # a join refused, or "hang"
        server.hang_paths = frozenset(filter(None, os.environ.get("FAKE_SGLANG_HANG", "").split(",")))  # e.g. /flush_cache
        await server.start(args.host, args.port)
        log.info("serving %s on %s", args.model_path, server.url)
        await asyncio.Event().wait()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A stand-in SGLang HTTP server held to SGLang's own schema (a real server needs a GPU).

Every request body is checked with the installed SGLang 0.5.x sources, never with a
copy of them:
  * ``/generate`` bodies with ``sglang/api/v1/api_types.py`` (``GenerateRequest``, the
    same generated decoder the real server's contract gate runs; its ``SamplingParams``
    rejects unknown keys);
  * control endpoints with the field lists of the request classes in
    ``sglang/srt/managers/io_struct.py`` (read with ``ast``: that module needs a GPU
    stack to import);
  * launcher argv with the CLI fields declared in ``sglang/srt/arg_groups/fields``.
Answers are built as api_types structs and encoded with their ``to_json_value``.

Generation is real: the backend is a LocalEngine over a tiny HF model, so answers carry
true sampled ids and log-probs. Run as a script it is a server process that the launcher
can start (``python fake_sglang.py --model-path DIR --port N ...``) and that joins a
weight-update group with SGLang's own ``init_custom_process_group`` (gloo on CPU).
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import functools
import importlib.util
import logging
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

log = logging.getLogger("fake_sglang")


# ---------------------------------------------------------------------- SGLang's own schema


@functools.cache
def sglang_root() -> Path:
    spec = importlib.util.find_spec("sglang")  # a top-level spec: the package is not imported
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("sglang is not installed (pip install --no-deps sglang==0.5.23)")
    return Path(spec.submodule_search_locations[0])


@functools.cache
def api_types():
    """sglang/api/v1/api_types.py loaded alone (it needs only msgspec)."""
    path = sglang_root() / "api" / "v1" / "api_types.py"
    spec = importlib.util.spec_from_file_location("sglang_api_v1_types", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@functools.cache
def _io_struct_classes() -> dict[str, ast.ClassDef]:
    tree = ast.parse((sglang_root() / "srt" / "managers" / "io_struct.py").read_text())
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


@functools.cache
def io_struct_fields(class_name: str) -> dict[str, tuple[str, bool]]:
    """Field name -> (annotation source, required) of an io_struct request class, with its bases."""
    classes = _io_struct_classes()
    if class_name not in classes:
        raise KeyError(f"{class_name} not in SGLang's io_struct.py")
    fields: dict[str, tuple[str, bool]] = {}
    node = classes[class_name]
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            fields.update(io_struct_fields(base.id))
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            fields[stmt.target.id] = (ast.unparse(stmt.annotation), stmt.value is None)
    return fields


_JSON_TYPES = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,)}


def check_io_struct(class_name: str, body: Any) -> str | None:
    """What is wrong with ``body`` as JSON for io_struct ``class_name`` (None when it fits)."""
    if not isinstance(body, dict):
        return f"{class_name}: body is not a JSON object"
    fields = io_struct_fields(class_name)
    unknown = sorted(set(body) - set(fields))
    if unknown:
        return f"{class_name}: unknown field(s) {unknown}; SGLang has {sorted(fields)}"
    missing = sorted(name for name, (_, required) in fields.items() if required and name not in body)
    if missing:
        return f"{class_name}: missing required field(s) {missing}"
    for name, value in body.items():
        annotation = fields[name][0]
        optional = annotation.startswith("Optional[")
        base = annotation[len("Optional["):-1] if optional else annotation
        if value is None and optional:
            continue
        if base in _JSON_TYPES:
            ok = isinstance(value, _JSON_TYPES[base]) and not (base != "bool" and isinstance(value, bool))
            if not ok:
                return f"{class_name}.{name}: {value!r} is not {annotation}"
        elif base.startswith(("List[", "Annotated[List[")) and not isinstance(value, list):
            return f"{class_name}.{name}: {value!r} is not a list ({annotation})"
        elif base.startswith("Literal["):
            allowed = tuple(ast.literal_eval(e) for e in ast.parse(base, mode="eval").body.slice.elts)
            if value not in allowed:
                return f"{class_name}.{name}: {value!r} not in {allowed}"
    return None


@functools.cache
def server_cli_flags() -> frozenset[str]:
    """The ``--flags`` SGLang's ServerArgs registers from its declared fields."""
    flags: set[str] = set()
    for path in sorted((sglang_root() / "srt" / "arg_groups" / "fields").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            ann = node.annotation
            if not (isinstance(ann, ast.Subscript) and getattr(ann.value, "id", None) == "A"):
                continue
            meta = ann.slice.elts[1] if isinstance(ann.slice, ast.Tuple) and len(ann.slice.elts) > 1 else None
            names = ["--" + node.target.id.replace("_", "-")]
            if isinstance(meta, ast.Call) and getattr(meta.func, "id", None) == "Arg":
                kw = {k.arg: k.value for k in meta.keywords}
                if "no_cli" in kw and ast.literal_eval(kw["no_cli"]):
                    continue
                if "cli_name" in kw:
                    names[0] = ast.literal_eval(kw["cli_name"])
                if "aliases" in kw:
                    names += list(ast.literal_eval(kw["aliases"]))
            elif not (isinstance(meta, ast.Constant) and isinstance(meta.value, str)):
                continue
            flags.update(names)
    return frozenset(flags)


@functools.cache
def sglang_init_custom_process_group():
    """SGLang's own ``init_custom_process_group`` (utils/common.py), compiled from its source."""
    import torch

    source = (sglang_root() / "srt" / "utils" / "common.py").read_text()
    func = next(n for n in ast.parse(source).body
                if isinstance(n, ast.FunctionDef) and n.name == "init_custom_process_group")
    namespace: dict[str, Any] = {"torch": torch, "torch_release": tuple(
        int(p) for p in torch.__version__.split("+")[0].split(".")[:2])}
    exec(compile(ast.Module(body=[func], type_ignores=[]), "sglang/srt/utils/common.py", "exec"), namespace)
    return namespace["init_custom_process_group"]


# ---------------------------------------------------------------------- the server


DROP_CONNECTION = object()  # a /generate handler returns this to cut the connection without an answer
GenerateHandler = Callable[[Any, dict], Awaitable[Any]]  # (GenerateRequest, raw body) -> struct | (status, dict)

_CONTROL = {
    "/flush_cache": None,
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/abort_request": "AbortReq",
}


class FakeSGLangServer:
    """aiohttp app with SGLang's native endpoints; records every request and contract error."""

    def __init__(self, generate: GenerateHandler, *, engine=None, join_weight_groups: bool = False) -> None:
        self.generate_handler = generate
        self.engine = engine  # LocalEngine behind /generate, for pause / weights
        self.join_weight_groups = join_weight_groups  # really join /init_weights_update_group (own process only)
        self.requests: list[tuple[str, Any]] = []
        self.contract_errors: list[str] = []
        self.healthy = True
        self.memory_released: set[str] = set()
        self.update_group = None
        self.weight_version: str | None = None
        self.runner: web.AppRunner | None = None
        self.url = ""
        app = web.Application(client_max_size=1 << 30)
        app.router.add_get("/health", self._health)
        app.router.add_post("/generate", self._generate)
        for path in _CONTROL:
            app.router.add_post(path, self._control)
        self.app = app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self.runner = web.AppRunner(self.app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        return self.url

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    def _reject(self, message: str) -> web.Response:
        self.contract_errors.append(message)
        return web.json_response({"error": {"message": message}}, status=400)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(("/generate", body))
        types = api_types()
        try:
            parsed = types.GenerateRequest.from_json_value(body)
            if isinstance(parsed.sampling_params, dict):  # pragma: no cover - decoder returns structs
                types.SamplingParams.from_json_value(parsed.sampling_params)
        except types.JsonContractError as exc:
            return self._reject(f"/generate: {exc}")
        answer = await self.generate_handler(parsed, body)
        if answer is DROP_CONNECTION:  # the connection dies after the request arrived
            request.transport.abort()
            return web.Response(status=200)
        if isinstance(answer, tuple):  # (status, raw JSON): deliberate failures in tests
            status, raw = answer
            return web.json_response(raw, status=status)
        if self.weight_version is not None and answer.meta_info is not None:  # as set by the last weight update
            import msgspec

            answer = msgspec.structs.replace(
                answer, meta_info=msgspec.structs.replace(answer.meta_info, weight_version=self.weight_version))
        return web.json_response(answer.to_json_value())

    async def _control(self, request: web.Request) -> web.Response:
        path = request.path
        body = await request.json() if request.can_read_body else {}
        self.requests.append((path, body))
        if _CONTROL[path] is not None and (problem := check_io_struct(_CONTROL[path], body)):
            return self._reject(problem)
        handler = getattr(self, "_do_" + path.strip("/"), None)
        if handler is not None:
            answer = await handler(body)
            if answer is not None:
                return answer
        if path in ("/init_weights_update_group", "/update_weights_from_distributed",
                    "/update_weights_from_tensor", "/destroy_weights_update_group"):
            return web.json_response({"success": True, "message": "ok"})
        return web.json_response({"message": "ok", "status": "ok"})

    async def _do_pause_generation(self, body: dict) -> None:
        if self.engine is not None:
            await self.engine.pause(abort_in_flight=body.get("mode", "abort") == "abort")

    async def _do_continue_generation(self, body: dict) -> None:
        if self.engine is not None:
            await self.engine.resume()

    async def _do_release_memory_occupation(self, body: dict) -> None:
        self.memory_released.update(body.get("tags") or ["weights", "kv_cache"])

    async def _do_resume_memory_occupation(self, body: dict) -> None:
        self.memory_released.difference_update(body.get("tags") or ["weights", "kv_cache"])

    async def _do_init_weights_update_group(self, body: dict) -> web.Response | None:
        if not self.join_weight_groups:
            return None
        init = sglang_init_custom_process_group()
        loop = asyncio.get_running_loop()
        self.update_group = await loop.run_in_executor(None, lambda: init(
            backend=body.get("backend", "nccl"),
            init_method=f"tcp://{body['master_address']}:{body['master_port']}",
            world_size=body["world_size"], rank=body["rank_offset"],
            group_name=body.get("group_name", "weight_update_group")))
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def _do_update_weights_from_distributed(self, body: dict) -> web.Response | None:
        import torch
        import torch.distributed as dist

        if not self.join_weight_groups:
            return None
        if self.update_group is None:
            return web.json_response({"success": False, "message": "no weight update group"}, status=400)

        def receive():
            received = []
            for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"]):
                tensor = torch.empty(shape, dtype=getattr(torch, dtype))
                dist.broadcast(tensor, src=0, group=self.update_group)
                received.append((name, tensor))
            return received

        received = await asyncio.get_running_loop().run_in_executor(None, receive)
        try:
            await self.engine.update_weights(received)
        except ValueError as exc:
            return web.json_response({"success": False, "message": str(exc)}, status=400)
        if body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
        return web.json_response({"success": True, "message": "Succeeded to update parameter online."})


# ---------------------------------------------------------------------- a real backend


def local_engine_handler(engine) -> GenerateHandler:
    """Serve /generate with a LocalEngine, answering with api_types structs like SGLang does."""
    from megatron_tir.rollout.engines.base import FinishReason, SamplingParams

    types = api_types()

    async def handle(req, body: dict):
        sp = req.sampling_params
        stop = sp.stop if isinstance(sp.stop, list) else [sp.stop] if sp.stop else []
        params = SamplingParams(max_new_tokens=sp.max_new_tokens, temperature=sp.temperature, top_p=sp.top_p,
                                top_k=sp.top_k, stop=tuple(stop), seed=sp.sampling_seed)
        out = await engine.generate(req.input_ids, params)
        if out.finish_reason is FinishReason.STOP:
            finish = types.FinishStop(matched=out.matched_stop)
        elif out.finish_reason is FinishReason.EOS:
            finish = types.FinishStop(matched=out.token_ids[-1])
        elif out.finish_reason is FinishReason.LENGTH:
            finish = types.FinishLength(length=len(out.token_ids))
        else:
            finish = types.FinishAbort(message="Abort before prefill" if not out.token_ids else "Aborted")
        meta = types.GenerateMetaInfo(
            id=req.rid or "", prompt_tokens=len(req.input_ids), completion_tokens=len(out.token_ids),
            finish_reason=finish,
            output_token_logprobs=[types.LogprobEntry(logprob=lp, token_id=t, text=None)
                                   for t, lp in zip(out.token_ids, out.logprobs)],
            weight_version=str(out.meta.get("weight_version", 0)))
        return types.GenerateResponse(text=engine.tokenizer.decode(out.token_ids), meta_info=meta,
                                      output_ids=list(out.token_ids))

    return handle


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
    args, _ = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s fake_sglang %(message)s")

    async def serve() -> None:
        from megatron_tir.rollout.engines.local import LocalEngine, LocalEngineConfig

        engine = LocalEngine(LocalEngineConfig(model=args.model_path, seed=args.random_seed, torch_threads=1))
        server = FakeSGLangServer(local_engine_handler(engine), engine=engine, join_weight_groups=True)
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

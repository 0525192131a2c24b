"""What serves a fake SGLang server's ``/generate`` (fake_sglang.py): a LocalEngine answering
with SGLang 0.5.23's own api_types structs, and a fake on an event loop of its own in a thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sglang_schema import api_types

if TYPE_CHECKING:  # fake_sglang.main imports this module (it may run as __main__)
    from fake_sglang import FakeSGLangServer, GenerateHandler


def local_engine_handler(engine) -> GenerateHandler:
    """Serve /generate with a LocalEngine, answering with api_types structs like SGLang does.

    The LocalEngine stops on the model's EOS ids; a request's ``stop_token_ids`` end it at
    the first such id (sampling is causal and per-request seeded, so cutting there is what
    stopping there would have produced).
    """
    from megatron_tir.rollout.engines.base import FinishReason, SamplingParams

    types = api_types()

    async def handle(req, body: dict):
        sp = req.sampling_params
        stop = sp.stop if isinstance(sp.stop, list) else [sp.stop] if sp.stop else []
        params = SamplingParams(max_new_tokens=sp.max_new_tokens, temperature=sp.temperature, top_p=sp.top_p,
                                top_k=sp.top_k, stop=tuple(stop), seed=sp.sampling_seed)
        out = await engine.generate(req.input_ids, params)
        ids, logprobs, reason = list(out.token_ids), list(out.logprobs), out.finish_reason
        stop_ids = set(sp.stop_token_ids or ())
        cut = next((i for i, t in enumerate(ids) if t in stop_ids), None)
        if cut is not None and not (reason is FinishReason.EOS and cut == len(ids) - 1):
            ids, logprobs, reason = ids[: cut + 1], logprobs[: cut + 1], FinishReason.EOS
        if reason is FinishReason.STOP:
            finish = types.FinishStop(matched=out.matched_stop)
        elif reason is FinishReason.EOS:
            finish = types.FinishStop(matched=ids[-1])
        elif reason is FinishReason.LENGTH:
            finish = types.FinishLength(length=len(ids))
        else:
            finish = types.FinishAbort(message="Abort before prefill" if not ids else "Aborted")
        spans = [types.WeightVersionSpan(version=s["version"], start=s["start"], end=min(s["end"], len(ids)))
                 for s in out.meta.get("weight_versions", []) if s["start"] < len(ids)]
        meta = types.GenerateMetaInfo(
            id=req.rid or "", prompt_tokens=len(req.input_ids), completion_tokens=len(ids), finish_reason=finish,
            output_token_logprobs=[types.LogprobEntry(logprob=lp, token_id=t, text=None)
                                   for t, lp in zip(ids, logprobs)],
            weight_versions=spans)
        return types.GenerateResponse(text=engine.tokenizer.decode(ids), meta_info=meta, output_ids=ids)

    return handle


def serve_in_thread(make: Callable[[], FakeSGLangServer], port: int = 0) -> tuple[FakeSGLangServer, Callable[[], None]]:
    """A fake on its own event loop in a daemon thread (its timers run while the caller's loop
    is blocked); returns the started server and a function that stops it."""
    ready = threading.Event()
    box: dict[str, Any] = {}

    def run() -> None:
        loop = asyncio.new_event_loop()
        box["loop"] = loop
        server = make()
        loop.run_until_complete(server.start(port=port))
        box["server"] = server
        ready.set()
        loop.run_forever()
        loop.run_until_complete(server.stop())
        loop.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(30), "fake server did not start"

    def stop() -> None:
        box["loop"].call_soon_threadsafe(box["loop"].stop)
        thread.join(10)

    return box["server"], stop

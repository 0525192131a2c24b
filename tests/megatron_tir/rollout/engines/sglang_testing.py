"""Helpers for the SGLang client tests: a client on fake servers, scripted answers, free ports."""

from __future__ import annotations

import contextlib
import socket

from megatron_tir.rollout.engines.sglang import SGLangEngine, SGLangEngineConfig

from sglang_schema import api_types

EOS = (0,)


def client(urls, **overrides) -> SGLangEngine:
    overrides.setdefault("health_check_interval_s", 0)
    overrides.setdefault("retry_backoff_s", 0)
    overrides.setdefault("eos_token_ids", EOS)
    return SGLangEngine(SGLangEngineConfig(server_urls=tuple(urls), **overrides))


def scripted(answer):
    """A /generate handler that answers from a function of the parsed request."""
    async def handle(req, body):
        return answer(req) if callable(answer) else answer
    return handle


def canned_response(req, *, ids=(5, 6, 7), finish=None, version="default"):
    """An answer as sglang 0.5.23 gives it; ``meta_info.weight_version(s)`` as
    ``srt/utils/weight_versions.py`` ``add_weight_versions_to_meta_info`` writes them (one span)."""
    types = api_types()
    finish = finish or types.FinishLength(length=len(ids))
    meta = types.GenerateMetaInfo(id=req.rid, prompt_tokens=len(req.input_ids), completion_tokens=len(ids),
                                  finish_reason=finish,
                                  output_token_logprobs=[types.LogprobEntry(logprob=-0.5 * (i + 1), token_id=t)
                                                         for i, t in enumerate(ids)],
                                  weight_version=version,
                                  weight_versions=[types.WeightVersionSpan(version=version, start=0, end=len(ids))])
    return types.GenerateResponse(text="", meta_info=meta, output_ids=list(ids))


@contextlib.contextmanager
def unreachable_url():
    """A URL whose TCP connect never completes: a listener with a full backlog (SYNs dropped)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(4):
        filler = socket.socket()
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect(("127.0.0.1", port))
        fillers.append(filler)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        for sock in (*fillers, listener):
            sock.close()

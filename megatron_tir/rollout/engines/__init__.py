"""Generation engines: token ids in; sampled ids, their log-probs and the finish reason out.

``LocalEngine`` (torch, in process; the CPU default) and ``SGLangEngine`` (HTTP client
for SGLang servers on GPUs) implement :class:`GenerationEngine`. They are imported on
first use, so importing this package loads neither torch models nor aiohttp.
"""

from __future__ import annotations

import importlib

from megatron_tir.rollout.engines.base import (
    DEFAULT_PAUSE_MODE,
    FinishReason,
    Generation,
    GenerationEngine,
    PauseMode,
    SamplingParams,
)

_LAZY = {
    "LocalEngine": "local", "LocalEngineConfig": "local",
    "SGLangEngine": "sglang", "SGLangEngineConfig": "sglang", "SGLangError": "sglang",
    "SGLangServer": "sglang", "SGLangServerConfig": "sglang",
    "resolve_eos_token_ids": "eos",
}

__all__ = ["DEFAULT_PAUSE_MODE", "FinishReason", "Generation", "GenerationEngine", "PauseMode", "SamplingParams",
           *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

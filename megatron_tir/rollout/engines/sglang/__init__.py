"""SGLang servers as a generation engine: the HTTP client and the server launcher.

``wire`` (the /generate request and answer), ``pool`` (health and routing), ``client``
(:class:`SGLangEngine`: generate, health, weight versions), ``control`` (its control endpoints,
mixed in), ``server`` (launching ``sglang.launch_server``) and ``kind`` (the ``sglang`` entry of
:data:`megatron_tir.rollout.factory.ENGINE_KINDS`). The weight syncs that drive the control
endpoints live in :mod:`megatron_tir.rollout.sync`. The names below are imported on first use,
so the engine-kind registry loads no HTTP client.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "SGLangEngine": "client", "SGLangEngineConfig": "client",
    "SGLangServer": "server", "SGLangServerConfig": "server",
    "SGLangError": "wire", "build_generate_request": "wire", "parse_generate_response": "wire",
}

__all__ = ["SGLangEngine", "SGLangEngineConfig", "SGLangError", "SGLangServer", "SGLangServerConfig",
           "build_generate_request", "parse_generate_response"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

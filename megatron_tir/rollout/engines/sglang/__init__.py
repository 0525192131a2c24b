"""SGLang servers as a generation engine: the HTTP client and the server launcher.

``wire`` (the /generate request and answer), ``pool`` (health and routing), ``client``
(:class:`SGLangEngine`: generate, health, weight versions), ``control`` (its control endpoints,
mixed in) and ``server`` (launching
``sglang.launch_server``). The weight sync that drives the control endpoints lives in
:mod:`megatron_tir.rollout.sync.sglang`.
"""

from megatron_tir.rollout.engines.sglang.client import SGLangEngine, SGLangEngineConfig
from megatron_tir.rollout.engines.sglang.server import SGLangServer, SGLangServerConfig
from megatron_tir.rollout.engines.sglang.wire import SGLangError, build_generate_request, parse_generate_response

__all__ = ["SGLangEngine", "SGLangEngineConfig", "SGLangError", "SGLangServer", "SGLangServerConfig",
           "build_generate_request", "parse_generate_response"]

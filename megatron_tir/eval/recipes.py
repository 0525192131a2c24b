"""Named evaluation settings (``megatron-tir eval --recipe NAME``); flags and ``--set`` apply on top.

``qwen2.5-7b-simpletir-eval`` -- SimpleTIR's evaluation of Qwen2.5-7B: AIME24, AIME25 and
MATH500, n = 32 samples per problem (avg@32), up to 10 turns, temperature 1.0 with top-p
0.7, the released code's prompt and feedback format (``protocol="simpletir"``), on SGLang
servers. The response budget is the paper's extended one (24K tokens, with the 10 turns).
"""

from __future__ import annotations

from collections.abc import Callable

from megatron_tir.eval.runner import EvalConfig
from megatron_tir.rollout.driver import RolloutConfig
from megatron_tir.rollout.factory import EngineConfig


def qwen25_7b_simpletir_eval() -> EvalConfig:
    return EvalConfig(
        data=("aime24", "aime25", "math500"),
        engine=EngineConfig(kind="sglang", model="Qwen2.5-7B", urls=("http://localhost:30000",)),
        rollout=RolloutConfig(n_samples=32, max_turns=10, max_response_tokens=24576, temperature=1.0, top_p=0.7,
                              protocol="simpletir", max_in_flight=1024),
    )


EVAL_RECIPES: dict[str, Callable[[], EvalConfig]] = {
    "qwen2.5-7b-simpletir-eval": qwen25_7b_simpletir_eval,
}


def load_eval_recipe(name: str) -> EvalConfig:
    if name not in EVAL_RECIPES:
        raise ValueError(f"unknown eval recipe {name!r} (recipes: {', '.join(EVAL_RECIPES)})")
    return EVAL_RECIPES[name]()

"""``megatron-tir eval``: its flags, mapped onto one :class:`~megatron_tir.eval.runner.EvalConfig`.

Every flag names one config field (shown in its help); a flag not given leaves the
field's default, which lives in the config and only there. The config's own checks are
the flag checks (a bad value is a one-line error, exit 2).
"""

from __future__ import annotations

import argparse
import math

# flag dest -> (section, field); section "" is EvalConfig itself
FLAG_FIELDS: dict[str, tuple[str, str]] = {
    "data": ("", "data"), "limit": ("", "limit"), "out": ("", "out"),
    "max_infra_failure_share": ("", "max_infra_failure_share"), "probe_timeout": ("", "probe_timeout_s"),
    "model": ("engine", "model"), "engine": ("engine", "kind"), "sglang_url": ("engine", "urls"),
    "batch_size": ("engine", "max_batch_size"),
    "sandbox": ("sandbox", "address"), "sandbox_workers": ("sandbox", "workers"),
    "k": ("rollout", "n_samples"), "max_turns": ("rollout", "max_turns"),
    "max_response_tokens": ("rollout", "max_response_tokens"), "temperature": ("rollout", "temperature"),
    "top_p": ("rollout", "top_p"), "top_k": ("rollout", "top_k"), "seed": ("rollout", "seed"),
    "tool_timeout": ("rollout", "tool_timeout_s"), "protocol": ("rollout", "protocol"),
    "void_turn": ("rollout", "void_turn"), "tools": ("rollout", "tools"),
    "prompt_mode": ("prompt", "mode"),
}


def _finite_float(text: str) -> float:
    """A float flag's value: NaN and ±inf are refused here (argparse names the flag, exit 2)."""
    value = float(text)  # ValueError: argparse says the flag has an invalid value
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    help_text = "evaluate a model with multi-turn TIR rollouts (avg@k, pass@k, TIR metrics)"
    p = sub.add_parser("eval", help=help_text, description=help_text, argument_default=argparse.SUPPRESS)
    p.add_argument("--model", required=True, help="engine.model: smollm2, tiny-qwen2, an HF model directory, or a checkpoint (run dir: its latest step; step dir; policy checkpoint)")
    p.add_argument("--data", required=True, help="aime24 | aime25 | math500 | math_train | a verl parquet file")
    p.add_argument("--limit", type=int, help="limit: evaluate the first M problems")
    p.add_argument("--out", help="out: one JSON line per sample (text, turns, tool results, reward)")
    p.add_argument("--k", type=int, help="rollout.n_samples: samples per problem (avg@k, pass@k; default 4)")
    p.add_argument("--max-turns", type=int, help="rollout.max_turns")
    p.add_argument("--max-response-tokens", type=int,
                   help="rollout.max_response_tokens: model + feedback tokens per trajectory (default 512)")
    p.add_argument("--temperature", type=_finite_float, help="rollout.temperature")
    p.add_argument("--top-p", type=_finite_float, help="rollout.top_p")
    p.add_argument("--top-k", type=int, help="rollout.top_k (-1: off)")
    p.add_argument("--seed", type=int, help="rollout.seed")
    p.add_argument("--protocol", help="rollout.protocol: default | simpletir (the released SimpleTIR code's)")
    p.add_argument("--void-turn", help="rollout.void_turn: stop | continue")
    p.add_argument("--no-tools", dest="tools", action="store_false", help="rollout.tools=false: text-only, one turn")
    p.add_argument("--tool-timeout", type=_finite_float, help="rollout.tool_timeout_s: seconds per code execution")
    p.add_argument("--prompt-mode", help="rollout.prompt.mode: plain (base models) | chat (the chat template)")
    p.add_argument("--engine", help="engine.kind: local | sglang")
    p.add_argument("--sglang-url", action="append", help="engine.urls: an SGLang server URL (repeat for several)")
    p.add_argument("--batch-size", type=int, help="engine.max_batch_size: local engine requests decoded together")
    p.add_argument("--sandbox", help="sandbox.address: broker address (default: start a local cluster)")
    p.add_argument("--sandbox-workers", type=int, help="sandbox.workers: workers of the local cluster")
    p.add_argument("--max-infra-failure-share", type=_finite_float,
                   help="fail (exit 1) when engine/sandbox failures end more than this share of trajectories")
    p.add_argument("--probe-timeout", type=_finite_float, help="probe_timeout_s: start-up checks of engine and sandbox")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.set_defaults(func=run_eval_command)


def config_from_args(args: argparse.Namespace):
    """The one EvalConfig the flags describe (each section built once, from its defaults)."""
    from megatron_tir.eval.runner import EVAL_ROLLOUT_DEFAULTS, EvalConfig
    from megatron_tir.rollout.driver import RolloutConfig
    from megatron_tir.rollout.factory import EngineConfig, SandboxConfig
    from megatron_tir.tir.prompt import PromptConfig

    given: dict[str, dict] = {"": {}, "engine": {}, "sandbox": {}, "rollout": {}, "prompt": {}}
    for dest, (section, name) in FLAG_FIELDS.items():
        if hasattr(args, dest):
            value = getattr(args, dest)
            given[section][name] = tuple(value) if isinstance(value, list) else value
    rollout_kw = {**EVAL_ROLLOUT_DEFAULTS, **given["rollout"]}
    if given["prompt"]:
        rollout_kw["prompt"] = PromptConfig(**given["prompt"])
    return EvalConfig(**given[""], engine=EngineConfig(**given["engine"]), sandbox=SandboxConfig(**given["sandbox"]),
                      rollout=RolloutConfig(**rollout_kw))


def run_eval_command(args: argparse.Namespace) -> int:
    from megatron_tir.eval.runner import run_eval

    cfg = config_from_args(args)
    metrics, _ = run_eval(cfg, progress=getattr(args, "progress", True))
    r = cfg.rollout
    print(f"== {cfg.data} | model {cfg.engine.model} | protocol {r.protocol} | k={cfg.k} | max turns "
          f"{r.max_turns if r.tools else 1} | max response tokens {r.max_response_tokens}")
    for line in metrics.lines():
        print(line)
    if cfg.out:
        print(f"per-sample results: {cfg.out}")
    return 0

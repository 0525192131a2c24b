"""``megatron-tir eval``: its flags, mapped onto one :class:`~megatron_tir.eval.runner.EvalConfig`.

    megatron-tir eval --model M --data aime24 --data math500 [--k 8] [--top-p 0.7] [--set rollout.max_turns=10]
    megatron-tir eval --recipe qwen2.5-7b-simpletir-eval --sglang-url http://host:30000 --out res/samples.jsonl

Every flag names one config field (shown in its help); a flag not given leaves the
field's default -- the config's, or the ``--recipe``'s (:mod:`megatron_tir.eval.recipes`)
-- and ``--set key=value`` (:func:`megatron_tir.config_io.apply_overrides`) reaches every
field, rollout knobs included, on top of both. The config's own checks are the flag checks
(a bad value is a one-line error, exit 2). Prints the overall metrics and one table with a
row per dataset and per data source (:mod:`megatron_tir.eval.report`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math

# flag dest -> (section, field); section "" is EvalConfig itself
FLAG_FIELDS: dict[str, tuple[str, str]] = {
    "data": ("", "data"), "limit": ("", "limit"), "out": ("", "out"), "out_tokens": ("", "out_tokens"),
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
    p.add_argument("--recipe", help="named settings the flags apply on top of: qwen2.5-7b-simpletir-eval")
    p.add_argument("--model", help="engine.model: smollm2, tiny-qwen2, an HF model directory, or a checkpoint "
                   "(run dir: its latest step; step dir; policy checkpoint)")
    p.add_argument("--data", action="append",
                   help="aime24 | aime25 | math500 | math_train | arithmetic | a verl parquet file (repeat for several)")
    p.add_argument("--limit", type=int, help="limit: evaluate the first M problems of each dataset")
    p.add_argument("--out", help="out: one JSON line per sample (text, turns, tool results, reward)")
    p.add_argument("--out-tokens", action="store_true",
                   help="out_tokens: the --out records carry token ids and loss mask (for megatron-tir sft)")
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
    p.add_argument("--set", dest="overrides", action="append", metavar="KEY=VALUE",
                   help="set any config key, e.g. rollout.max_turns=10 or engine.max_batch_size=16 (repeatable)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.set_defaults(func=run_eval_command)


def config_from_args(args: argparse.Namespace):
    """The one EvalConfig the flags describe (each section built once, from its defaults or the recipe's)."""
    from megatron_tir.config_io import apply_overrides
    from megatron_tir.eval.recipes import load_eval_recipe
    from megatron_tir.eval.runner import EVAL_ROLLOUT_DEFAULTS, EvalConfig
    from megatron_tir.rollout.driver import RolloutConfig
    from megatron_tir.rollout.factory import EngineConfig, SandboxConfig, engine_kind
    from megatron_tir.tir.prompt import PromptConfig

    given: dict[str, dict] = {"": {}, "engine": {}, "sandbox": {}, "rollout": {}, "prompt": {}}
    for dest, (section, name) in FLAG_FIELDS.items():
        if hasattr(args, dest):
            value = getattr(args, dest)
            given[section][name] = tuple(value) if isinstance(value, list) else value
    recipe = getattr(args, "recipe", None)
    if recipe is None:
        if "data" not in given[""]:
            raise ValueError("eval needs --data (or a --recipe that names its datasets)")
        if "model" not in given["engine"]:
            raise ValueError("eval needs --model (or a --recipe that names it)")
        rollout_kw = {**EVAL_ROLLOUT_DEFAULTS, **given["rollout"]}
        if given["prompt"]:
            rollout_kw["prompt"] = PromptConfig(**given["prompt"])
        cfg = EvalConfig(**given[""], engine=EngineConfig(**given["engine"]),
                         sandbox=SandboxConfig(**given["sandbox"]), rollout=RolloutConfig(**rollout_kw))
    else:
        base = load_eval_recipe(recipe)
        kind = given["engine"].get("kind")
        if kind is not None and engine_kind(kind).servers is None and "urls" not in given["engine"]:
            given["engine"]["urls"] = ()  # the recipe's server URLs mean nothing to an in-process engine
        rollout_kw = dict(given["rollout"])
        if given["prompt"]:
            rollout_kw["prompt"] = dataclasses.replace(base.rollout.prompt, **given["prompt"])
        cfg = dataclasses.replace(base, **given[""], engine=dataclasses.replace(base.engine, **given["engine"]),
                                  sandbox=dataclasses.replace(base.sandbox, **given["sandbox"]),
                                  rollout=dataclasses.replace(base.rollout, **rollout_kw))
    return apply_overrides(cfg, getattr(args, "overrides", None) or [])


def run_eval_command(args: argparse.Namespace) -> int:
    from megatron_tir.eval.runner import run_eval

    from megatron_tir.eval.report import METRICS_KEY, TABLE_KEY, format_table
    from megatron_tir.eval.runner import metrics_path

    cfg = config_from_args(args)
    result = run_eval(cfg, progress=getattr(args, "progress", True))
    r = cfg.rollout
    print(f"== {' + '.join(cfg.data)} | model {cfg.engine.model} | protocol {r.protocol} | k={cfg.k} | max turns "
          f"{r.max_turns if r.tools else 1} | max response tokens {r.max_response_tokens} | temperature "
          f"{r.temperature:g} | top-p {r.top_p:g}")
    for line in result.metrics.lines():
        print(line)
    print(f"  ({METRICS_KEY})")
    print()
    print(format_table(result.rows))
    print(f"  ({TABLE_KEY})")
    if cfg.out:
        print(f"per-sample results: {cfg.out}")
        print(f"metrics: {metrics_path(cfg.out)}")
    return 0

"""``megatron-tir``: the command line. One subcommand per job (``eval``; ``train`` joins later).

Each subcommand registers its parser in ``_SUBCOMMANDS`` with a function that builds the
arguments and one that runs them; bad input ends with a one-line error and exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

log = logging.getLogger("megatron_tir.cli")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


# ------------------------------------------------------------------------------- eval

def add_eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="'smollm2' or an HF model directory (SGLang: its tokenizer)")
    p.add_argument("--data", required=True, help="aime24 | aime25 | math500 | math_train | a verl parquet file")
    p.add_argument("--k", type=_positive_int, default=4, help="samples per problem (avg@k, pass@k)")
    p.add_argument("--max-turns", type=_positive_int, default=5)
    p.add_argument("--limit", type=_positive_int, default=None, help="evaluate the first M problems")
    p.add_argument("--max-response-tokens", type=_positive_int, default=512,
                   help="model + feedback tokens per trajectory (default 512, moderate for CPU)")
    p.add_argument("--temperature", type=_non_negative_float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-mode", choices=("plain", "chat"), default="plain",
                   help="plain prefix (base models, default) or the tokenizer's chat template")
    p.add_argument("--out", default=None, help="write one JSON line per sample (text, turns, tool results, reward)")
    p.add_argument("--sandbox", default=None, help="sandbox broker address (default: start a local cluster)")
    p.add_argument("--sandbox-workers", type=_positive_int, default=2, help="workers of the local cluster")
    p.add_argument("--tool-timeout", type=float, default=10.0, help="seconds per code execution")
    p.add_argument("--engine", choices=("local", "sglang"), default="local")
    p.add_argument("--sglang-url", action="append", default=[], help="SGLang server URL (repeat for several)")
    p.add_argument("--batch-size", type=_positive_int, default=8, help="local engine: requests decoded together")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_eval_command(args: argparse.Namespace) -> int:
    from megatron_tir.eval.runner import EvalConfig, run_eval
    from megatron_tir.rollout.driver import RolloutConfig

    cfg = EvalConfig(model=args.model, data=args.data, k=args.k, limit=args.limit, max_turns=args.max_turns,
                     max_response_tokens=args.max_response_tokens, temperature=args.temperature, top_p=args.top_p,
                     seed=args.seed, prompt_mode=args.prompt_mode, out=args.out, sandbox=args.sandbox,
                     sandbox_workers=args.sandbox_workers, tool_timeout_s=args.tool_timeout, engine=args.engine,
                     sglang_urls=tuple(args.sglang_url), batch_size=args.batch_size)
    # Validate the sampling/tool settings before loading anything.
    RolloutConfig(n_samples=cfg.k, max_turns=cfg.max_turns, max_response_tokens=cfg.max_response_tokens,
                  temperature=cfg.temperature, top_p=cfg.top_p, tool_timeout_s=cfg.tool_timeout_s)
    metrics, _ = run_eval(cfg, progress=not args.no_progress)
    print(f"== {args.data} | model {args.model} | k={cfg.k} | max turns {cfg.max_turns} | "
          f"max response tokens {cfg.max_response_tokens}")
    for line in metrics.lines():
        print(line)
    if args.out:
        print(f"per-sample results: {args.out}")
    return 0


_SUBCOMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "eval": ("evaluate a model with multi-turn TIR rollouts (avg@k, pass@k, TIR metrics)", add_eval_args,
             run_eval_command),
}


def _train_subcommands() -> dict:
    """``train`` and ``plot``, defined in megatron_tir.train.cli."""
    from megatron_tir.train.cli import SUBCOMMANDS

    return SUBCOMMANDS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-tir", description="Multi-turn tool-integrated reasoning RL.")
    parser.add_argument("--log-level", default="WARNING", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, add_args, run) in (_SUBCOMMANDS | _train_subcommands()).items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_args(p)
        p.set_defaults(_run=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        return args._run(args)
    except ValueError as exc:
        print(f"megatron-tir {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"megatron-tir {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""``megatron-tir``: the command line, one subcommand per job.

Each subcommand lives in its own module, which exposes ``register(subparsers)``: it adds
its parser and sets ``func`` (``set_defaults(func=...)``) to the function that runs it
and returns the exit status. Adding a subcommand is adding its module to
:data:`SUBCOMMAND_MODULES`.

One global ``--log-level {debug,info,warning,error}`` (default info) before the
subcommand. Bad input (data, model, flags, config values) prints one
``megatron-tir: error: ...`` line and exits 2; an engine or a sandbox that does not
answer, or infrastructure failures past the eval's allowed share, print one line and
exit 1.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from megatron_tir.observe.quiet import quiet_dependencies

PROG = "megatron-tir"
LOG_LEVELS = ("debug", "info", "warning", "error")
EXIT_BAD_INPUT = 2
EXIT_INFRASTRUCTURE = 1

# Modules with a register(subparsers) function, in the order `megatron-tir --help` lists them.
SUBCOMMAND_MODULES = ("megatron_tir.eval.cli", "megatron_tir.train.cli", "megatron_tir.sft.cli",
                      "megatron_tir.data.cli", "megatron_tir.observe.cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Multi-turn tool-integrated reasoning RL.")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="logging level (default: info)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


class _CurrentStderr:
    """``sys.stderr`` as it is when a line is written, not when logging was set up (a caller that swaps
    ``sys.stderr`` -- pytest's capture, a notebook -- would otherwise leave the handler on a closed stream)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), stream=_CurrentStderr(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    # megatron-core's bucket/config dumps and CPU fallback warnings, HF bars in log files (megatron_tir.observe.quiet)
    quiet_dependencies(logging.getLogger().getEffectiveLevel())
    from megatron_tir.rollout.factory import InfrastructureError

    try:
        return args.func(args)
    except InfrastructureError as exc:
        print(f"{PROG}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_INFRASTRUCTURE
    except ValueError as exc:
        print(f"{PROG}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

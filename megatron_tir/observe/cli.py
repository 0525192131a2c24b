"""``megatron-tir show`` (dumped trajectories) and ``megatron-tir plot`` (curves of one run or several).

    megatron-tir show RUN_DIR|FILE.jsonl[.gz] [--step N] [--filter void|correct|dropped|...] [--limit K]
    megatron-tir plot RUN_DIR [RUN_DIR ...] [--out DIR] [--smooth N]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_show_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory, or one dump / `eval --out` file "
                                                      "(.jsonl or .jsonl.gz)")
    p.add_argument("--step", type=int, help="the dump of this step (default: the latest)")
    p.add_argument("--filter", help="comma-separated, all must hold: void, correct, wrong, in_loss, dropped, code, "
                                    "train, eval, completed, truncated, max_turns, tool_failed, aborted")
    p.add_argument("--limit", type=int, default=5, help="trajectories shown (default 5; 0: all)")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                   help="dim the masked spans with escape codes (auto: on a terminal)")


def run_show_command(args: argparse.Namespace) -> int:
    from megatron_tir.observe.dumps import dump_path, dumped_steps, read_dump, read_records

    run_dir = Path(args.run_dir)
    if args.limit < 0:
        raise ValueError(f"--limit must be >= 0, got {args.limit}")
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    if run_dir.is_file():
        if args.step is not None:
            raise ValueError("--step is for a run directory; a file is one dump already")
        return _show(read_records(run_dir), args, color, f"of {run_dir}")
    steps = dumped_steps(run_dir)
    if not steps:
        raise ValueError(f"{run_dir}: no rollout dumps (RUN_DIR/rollouts/step_*.jsonl.gz; trainer.log.dump_every)")
    step = steps[-1] if args.step is None else args.step
    if step not in steps:
        raise ValueError(f"{run_dir}: no dump of step {step} (dumped steps: {', '.join(map(str, steps))})")
    return _show(read_dump(dump_path(run_dir, step)), args, color,
                 f"of step {step} (dumped steps: {', '.join(map(str, steps))})")


def _show(records: list[dict], args: argparse.Namespace, color: bool, where: str) -> int:
    from megatron_tir.observe.show import parse_filters, render, select

    records = select(records, parse_filters(args.filter))
    shown = records if args.limit == 0 else records[:args.limit]
    for rec in shown:
        print(render(rec, color=color))
        print()
    print(f"{len(shown)} of {len(records)} matching trajectories {where}")
    return 0


def add_plot_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dirs", metavar="RUN_DIR", nargs="+", help="one run, or several to overlay")
    p.add_argument("--out", help="output folder (default: RUN_DIR/plots for one run, ./plots-compare for several)")
    p.add_argument("--smooth", type=int, default=0, help="also draw a moving average over N steps (0: off)")


def run_plot_command(args: argparse.Namespace) -> int:
    from megatron_tir.observe.plots import plot_runs

    for path in plot_runs(args.run_dirs, out_dir=args.out, smooth=args.smooth):
        print(path)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    for name, help_text, add_args, func in (
            ("show", "render a run's dumped trajectories (turns, code, tool output, what the update did)",
             add_show_args, run_show_command),
            ("plot", "PNG curves and a dashboard of a run's metrics, or several runs overlaid", add_plot_args,
             run_plot_command)):
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_args(p)
        p.set_defaults(func=func)

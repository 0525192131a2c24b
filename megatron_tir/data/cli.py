"""``megatron-tir data``: prepare a local GSM8K / MATH / DeepScaleR-style file for training
(:mod:`megatron_tir.data.prepare`)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from megatron_tir.data.prepare import FORMATS, prepare

log = logging.getLogger(__name__)


def run_data_command(args: argparse.Namespace) -> int:
    written, bad = prepare(Path(args.input), Path(args.out), fmt=args.format, source=args.source, split=args.split,
                           limit=args.limit, skip_bad=args.skip_bad)
    for problem in bad[:10]:
        log.warning("%s: left out %s", args.input, problem)
    left_out = f"; {len(bad)} row(s) left out" if bad else ""
    print(f"{args.out}: {written} problems (verl schema){left_out}; train with --set data.train={args.out}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    help_text = "convert a local GSM8K / MATH / DeepScaleR-style file (jsonl, json, parquet) to the verl parquet schema"
    p = sub.add_parser("data", help=help_text, description=help_text)
    p.add_argument("input", metavar="FILE", help="the input: .jsonl, .json (a list) or .parquet")
    p.add_argument("--out", required=True, metavar="FILE.parquet", help="the verl-schema parquet to write")
    p.add_argument("--format", choices=FORMATS, default="auto",
                   help="gsm8k: question + 'answer ... #### N'; math: problem + solution with \\boxed{}; "
                        "deepscaler: problem + answer; verl: checked and copied; auto (default): by the keys")
    p.add_argument("--source", help="data_source of every row (default: the input file's name)")
    p.add_argument("--split", default="train", help="extra_info.split of every row (default: train)")
    p.add_argument("--limit", type=int, help="only the first N rows")
    p.add_argument("--skip-bad", action="store_true", help="leave out rows that do not fit (counted) instead of failing")
    p.set_defaults(func=run_data_command)

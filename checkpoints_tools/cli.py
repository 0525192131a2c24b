"""``tir-ckpt``: HF <-> Megatron conversion, resharding and parity checks.

    tir-ckpt hf-to-megatron --hf DIR|smollm2 --out DIR [--tp N --pp M]
    tir-ckpt megatron-to-hf --ckpt DIR|RUN_DIR --out DIR
    tir-ckpt reshard --ckpt DIR --out DIR --tp N --pp M [--ep E]
    tir-ckpt verify --hf DIR|smollm2 --ckpt DIR [--tp N --pp M --ep E] [--atol 1e-3] [--dtype float32]
    tir-ckpt keymap [--family llama|qwen2|qwen3|qwen3_moe]

One global ``--log-level {debug,info,warning,error}`` (default info) before the subcommand.

Bad input (unknown architecture, missing files, a layout that does not divide the
model, a checkpoint of another model) prints one ``tir-ckpt: error: ...`` line and exits
with status 2; so does a file of a run checkpoint that does not match the checkpoint's
manifest (size and CRC-32, ``megatron_tir.policy.checkpoint.manifest``), named in that
line. Verification past tolerance exits with status 1. Outputs are written to
a temp dir next to ``--out`` and renamed only when complete.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from pathlib import Path

EXIT_BAD_INPUT = 2
EXIT_VERIFY_FAILED = 1


LOG_LEVELS = ("debug", "info", "warning", "error")


def _keymap(args: argparse.Namespace) -> int:
    from megatron_tir.policy.keymap import KEY_MAPS, table

    for family in [args.family] if args.family else sorted(KEY_MAPS):
        print(f"### {family}\n\n{table(family)}\n")
    return 0


def _hf_to_megatron(args: argparse.Namespace) -> int:
    from checkpoints_tools.convert import hf_to_megatron

    out = hf_to_megatron(args.hf, args.out, tp=args.tp, pp=args.pp)
    print(f"wrote Megatron checkpoint {out} (loads at any TP/PP; checked for tp={args.tp} pp={args.pp})")
    return 0


def _megatron_to_hf(args: argparse.Namespace) -> int:
    from checkpoints_tools.convert import megatron_to_hf

    if args.max_shard_gb <= 0:
        raise ValueError("--max-shard-gb must be positive")
    out = megatron_to_hf(args.ckpt, args.out, max_shard_bytes=int(args.max_shard_gb * 2**30))
    print(f"wrote HF model {out}")
    return 0


def _reshard(args: argparse.Namespace) -> int:
    from checkpoints_tools.reshard import reshard

    out = reshard(args.ckpt, args.out, tp=args.tp, pp=args.pp, ep=args.ep)
    print(f"wrote Megatron checkpoint {out} with layout tp={args.tp} pp={args.pp} ep={args.ep}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from checkpoints_tools.verify import DEFAULT_TEXTS, VerifyConfig, verify

    cfg = VerifyConfig(tp=args.tp, pp=args.pp, ep=args.ep, atol=args.atol, min_argmax_agreement=args.min_argmax_agreement,
                       max_tokens=args.max_tokens, texts=tuple(args.text) if args.text else DEFAULT_TEXTS,
                       dtype=args.dtype)
    result = verify(args.hf, args.ckpt, cfg)
    layout = f"tp={args.tp} pp={args.pp}" + (f" ep={args.ep}" if args.ep > 1 else "")
    print(f"verify {args.ckpt} against {args.hf} at {layout}: {result.line(cfg)}")
    return 0 if result.ok else EXIT_VERIFY_FAILED


def _verify_files(ckpt: Path) -> None:
    """ValueError naming the first file of ``ckpt`` that does not match its manifest (a run checkpoint's)."""
    from megatron_tir.policy.checkpoint.layout import resolve_checkpoint
    from megatron_tir.policy.checkpoint.manifest import verify_checkpoint

    verify_checkpoint(resolve_checkpoint(ckpt))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tir-ckpt", description=__doc__.split("\n\n")[0])
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="logging level (default: info)")
    sub = p.add_subparsers(dest="command", required=True)

    h2m = sub.add_parser("hf-to-megatron", help="HF directory -> Megatron distributed checkpoint")
    h2m.add_argument("--hf", required=True, help="HF model directory, 'smollm2' or 'tiny-qwen2'")
    h2m.add_argument("--out", required=True, type=Path)
    h2m.add_argument("--tp", type=int, default=1, help="intended tensor parallel size (validated, recorded)")
    h2m.add_argument("--pp", type=int, default=1, help="intended pipeline parallel size (validated, recorded)")
    h2m.set_defaults(func=_hf_to_megatron)

    m2h = sub.add_parser("megatron-to-hf", help="Megatron checkpoint (or run dir) -> HF directory")
    m2h.add_argument("--ckpt", required=True, type=Path, help="checkpoint dir or run dir (latest iteration)")
    m2h.add_argument("--out", required=True, type=Path)
    m2h.add_argument("--max-shard-gb", type=float, default=5.0, help="split safetensors files above this size")
    m2h.set_defaults(func=_megatron_to_hf)

    rs = sub.add_parser("reshard", help="rewrite a checkpoint with an explicit TP x PP layout")
    rs.add_argument("--ckpt", required=True, type=Path)
    rs.add_argument("--out", required=True, type=Path)
    rs.add_argument("--tp", type=int, required=True)
    rs.add_argument("--pp", type=int, required=True)
    rs.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models)")
    rs.set_defaults(func=_reshard)

    vf = sub.add_parser("verify", help="logit parity: transformers vs megatron-core on the checkpoint")
    vf.add_argument("--hf", required=True, help="HF model directory, 'smollm2' or 'tiny-qwen2'")
    vf.add_argument("--ckpt", required=True, type=Path)
    vf.add_argument("--tp", type=int, default=1)
    vf.add_argument("--pp", type=int, default=1)
    vf.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models)")
    vf.add_argument("--atol", type=float, default=1e-3, help="max allowed |logit diff|")
    vf.add_argument("--min-argmax-agreement", type=float, default=0.99)
    vf.add_argument("--max-tokens", type=int, default=48)
    vf.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="compute dtype of both models (weights are cast on load)")
    vf.add_argument("--text", action="append", help="sample text (repeatable); default: built-in samples")
    vf.set_defaults(func=_verify)

    km = sub.add_parser("keymap", help="print the HF <-> Megatron key map as a markdown table")
    km.add_argument("--family", choices=("llama", "qwen2", "qwen3", "qwen3_moe"), default=None)
    km.set_defaults(func=_keymap)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    level = getattr(logging, args.log_level.upper())
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if level > logging.DEBUG:
        warnings.filterwarnings("ignore")  # megatron-core warns about missing TE/apex on import
        for noisy in ("megatron", "transformers", "torch"):
            logging.getLogger(noisy).setLevel(max(level, logging.WARNING))
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        if getattr(args, "ckpt", None) is not None:  # a damaged checkpoint is refused before it is read
            _verify_files(args.ckpt)
        return args.func(args)
    except (ValueError, FileNotFoundError, NotADirectoryError, PermissionError) as e:
        msg = " ".join(str(e).split()) or type(e).__name__
        print(f"tir-ckpt: error: {msg}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())

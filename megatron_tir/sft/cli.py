"""``megatron-tir collect`` and ``megatron-tir sft``: the cold start before RL.

    megatron-tir collect --recipe smollm2-cpu --prompts 64 [--start 0] [--set rollout.n_samples=8] --out good.jsonl.gz
    megatron-tir sft --recipe smollm2-cpu-sft --data good.jsonl.gz [--set steps=20] --out runs/sft
    megatron-tir sft --resume runs/sft [--set steps=40]
    megatron-tir train --recipe smollm2-cpu --set model=runs/sft --out runs/rl-from-sft

``collect`` takes a *train* recipe (``megatron_tir.train.recipes``: the model, training prompts,
rollout settings, engine, sandbox and reward of the RL run) and keeps its correct multi-turn
trajectories (:mod:`megatron_tir.sft.collect`). ``sft`` takes an sft recipe
(:data:`megatron_tir.sft.config.SFT_RECIPES`) or the defaults, ``--data`` files and ``--set``
overrides; every trainer rank runs it (torchrun for TP / PP / DP, like ``train``). Bad input is
one line, exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from pathlib import Path

from megatron_tir.observe.ranks import rank, run_on_every_rank, stopped_on_every_rank
from megatron_tir.train.run_dir import RUN_ENTRIES as COMMON_RUN_ENTRIES
from megatron_tir.train.run_dir import open_run_dir

log = logging.getLogger(__name__)

# what an sft run writes into its directory (train's, less its rollout dumps)
RUN_ENTRIES = COMMON_RUN_ENTRIES


# ----------------------------------------------------------------------------- collect

def add_collect_args(p: argparse.ArgumentParser) -> None:
    from megatron_tir.train.recipes import RECIPES

    p.add_argument("--recipe", required=True, metavar="NAME",
                   help=f"the RL run's train recipe (model, training prompts, rollout settings): {' | '.join(RECIPES)}")
    p.add_argument("--prompts", type=int, required=True, help="training prompts to sample")
    p.add_argument("--start", type=int, default=0, help="position of the first prompt in the training stream")
    p.add_argument("--k", type=int, help="samples per prompt (rollout.n_samples; default: the recipe's)")
    p.add_argument("--min-tool-calls", type=int, default=1,
                   help="keep trajectories that called a tool at least this often (default 1: multi-turn)")
    p.add_argument("--max-per-prompt", type=int, help="keep at most this many trajectories of a prompt")
    p.add_argument("--out", required=True, help="the kept trajectories: a .jsonl or .jsonl.gz file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key of the train recipe, e.g. model=runs/x or rollout.temperature=1.0")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def run_collect_command(args: argparse.Namespace) -> int:
    from megatron_tir.sft.collect import collect
    from megatron_tir.train.config import apply_overrides
    from megatron_tir.train.recipes import load_recipe

    overrides = list(args.overrides) + ([f"rollout.n_samples={args.k}"] if args.k is not None else [])
    cfg = apply_overrides(load_recipe(args.recipe), overrides)
    summary = collect(cfg, prompts=args.prompts, start=args.start, out=args.out, min_tool_calls=args.min_tool_calls,
                      max_per_prompt=args.max_per_prompt, progress=args.progress)
    print(f"== collect | {cfg.data.train} prompts {args.start}..{args.start + args.prompts - 1} | model {cfg.model} | "
          f"k={cfg.rollout.n_samples} | max turns {cfg.rollout.max_turns} | temperature {cfg.rollout.temperature:g}")
    for line in summary.lines():
        print(f"  {line}")
    print(f"kept trajectories: {args.out}" + ("" if summary.kept else " (none: nothing for sft to train on)"))
    return 0


# ----------------------------------------------------------------------------- sft

class RunFinished(Exception):
    """``--resume`` of a run that has done all its steps (exit 0)."""


def add_sft_args(p: argparse.ArgumentParser) -> None:
    from megatron_tir.sft.config import SFT_RECIPES

    src = p.add_mutually_exclusive_group()
    src.add_argument("--recipe", metavar="NAME", help=f"an sft recipe: {' | '.join(SFT_RECIPES)} (default: the defaults)")
    src.add_argument("--resume", metavar="RUN_DIR", help="continue the sft run in RUN_DIR from its latest checkpoint")
    p.add_argument("--data", action="append", default=[], metavar="FILE",
                   help="trajectory file: collect output, a rollout dump with token ids, eval --out-tokens, or "
                        "messages (.parquet / .jsonl); repeatable")
    p.add_argument("--model", help="model: the policy to fine-tune (named, HF directory or run checkpoint)")
    p.add_argument("--out", metavar="RUN_DIR", help="a new run directory")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. steps=20 or learner.lr=1e-5 (repeatable)")


def prepare(args: argparse.Namespace):
    """(config, run dir, trainer state) from the arguments; ValueError on bad input."""
    from megatron_tir.sft.config import SFTConfig, apply_overrides, from_dict, load_sft_recipe, to_dict
    from megatron_tir.train.checkpoint import STATE, TrainerState

    overrides = list(args.overrides)
    if args.model:
        overrides.insert(0, f"model={args.model}")
    run_dir, cfg, found, _ = open_run_dir(
        args.out, args.resume, parse=from_dict, update=lambda cfg: apply_overrides(cfg, overrides),
        fresh=lambda: apply_overrides(load_sft_recipe(args.recipe) if args.recipe else SFTConfig(), overrides),
        run_entries=RUN_ENTRIES, needs_out="sft needs --out RUN_DIR (or --resume RUN_DIR)",
        out_on_resume="--out is only used for a new run (a resumed run stays in its directory)",
        bad_config="{path}: not an sft run's config ({exc})")
    state = TrainerState()
    if args.resume is not None:
        state = TrainerState(**json.loads((found[0] / STATE).read_text()))
        if state.step >= cfg.steps:
            raise RunFinished(f"{run_dir} has done all its {state.step} steps: nothing to do (continue it with "
                              f"--set steps=N)")
    if args.data:  # (not a --set: a path may hold a comma)
        cfg = dataclasses.replace(cfg, data=tuple(args.data))
    if not cfg.data:
        raise ValueError("sft needs --data FILE (trajectories to fine-tune on)")
    for name in cfg.data:
        if not Path(name).is_file():
            raise ValueError(f"--data {name}: no such file")
    check_layout(cfg)
    state.config = to_dict(cfg)
    return cfg, run_dir, state


def check_layout(cfg, world_size: int | None = None) -> None:
    """ValueError (one line) unless learner.tp x learner.pp fit the model and the ranks (``WORLD_SIZE``, torchrun's;
    1 without it) -- train's check (:func:`megatron_tir.train.preflight.check_layout`: the model's config files
    only) -- and every data-parallel replica gets a row of each step: before the data is read or a process starts."""
    from megatron_tir.train.preflight import check_layout as check_model_layout, torchrun_world_size

    world = torchrun_world_size() if world_size is None else world_size
    check_model_layout(cfg.model, cfg.learner, world)
    dp = world // (cfg.learner.tp * cfg.learner.pp)
    if cfg.rows_per_step < dp:
        raise ValueError(f"rows_per_step={cfg.rows_per_step} is fewer than the {dp} data-parallel replicas")


def run_sft_command(args: argparse.Namespace) -> int:
    """Bad input is ValueError: one line, exit 2 (``megatron_tir.cli``), said by rank 0 alone; at the default level
    the INFO lines are rank 0's (:func:`megatron_tir.observe.ranks.run_on_every_rank`). Non-finite training stops
    every rank: one line from rank 0, exit 1 (:func:`megatron_tir.observe.ranks.stopped_on_every_rank`)."""
    return run_on_every_rank(_run_sft, args)


def _run_sft(args: argparse.Namespace) -> int:
    from megatron_tir.finite import NonFiniteTraining
    from megatron_tir.sft.loop import run_sft

    try:
        cfg, run_dir, state = prepare(args)
    except RunFinished as done:
        if rank() == 0:
            print(f"megatron-tir: {done}")
        return 0
    try:
        state = run_sft(cfg, run_dir, state, resume=args.resume is not None)
    except NonFiniteTraining as exc:  # every rank stops alike: rank 0 says it (stopped_on_every_rank)
        return stopped_on_every_rank(exc)
    if rank() == 0:
        print(f"fine-tuned to step {state.step}: {run_dir} (metrics: {run_dir / 'metrics.jsonl'}); "
              f"train from it with --set model={run_dir}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    for name, help_text, add_args, func in (
            ("collect", "rejection sampling: keep a model's correct multi-turn trajectories on training prompts",
             add_collect_args, run_collect_command),
            ("sft", "fine-tune a policy on multi-turn TIR trajectories (loss on model tokens only; --resume)",
             add_sft_args, run_sft_command)):
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_args(p)
        p.set_defaults(func=func)

"""``megatron-tir train``: argument parsing and run setup.

    megatron-tir train --recipe NAME [--set key=value ...] [key=value ...] --out RUN_DIR
    megatron-tir train --config FILE.yaml [--set key=value ...] --out RUN_DIR
    megatron-tir config --recipe NAME [--set key=value ...] > FILE.yaml
    megatron-tir train --resume RUN_DIR [--set key=value ...]

Every trainer rank runs ``train`` (torchrun/SPMD; RANK/WORLD_SIZE from the environment,
one process without them). Everything typed is checked before anything slow starts.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from megatron_tir.observe.ranks import rank, run_on_every_rank, stopped_on_every_rank
from megatron_tir.train.run_dir import RUN_ENTRIES as COMMON_RUN_ENTRIES
from megatron_tir.train.run_dir import open_run_dir

log = logging.getLogger(__name__)

LAUNCHER_ENTRIES = ("launch.json", "logs")  # tir-launch writes these into a run dir before the trainer starts
# what a run writes into its directory (a directory holding only these and no checkpoint can be reused)
RUN_ENTRIES = (*COMMON_RUN_ENTRIES, "rollouts")  # (its rollout dumps: megatron_tir.observe.dumps.DUMP_DIR)


def _recipe_names() -> str:
    from megatron_tir.train.recipes import RECIPES

    return " | ".join(RECIPES)


def _config_epilog() -> str:
    """``train --help``'s closing text: the recipes and the config's sections, read from the code."""
    from megatron_tir.train.config_reference import recipe_lines, section_names

    recipes = "\n".join(f"  {line}" for line in recipe_lines())
    return (f"recipes:\n{recipes}\n\nconfig sections (keys are dotted: SECTION.KEY=VALUE): "
            f"model, {', '.join(section_names())}\n"
            "every key, its default and its meaning: megatron-tir config --recipe NAME --explain, or docs/config.md")


def add_train_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--recipe", metavar="NAME", help=f"a recipe: {_recipe_names()}")
    src.add_argument("--config", metavar="FILE",
                     help="a config file: YAML from `megatron-tir config`, or a run's config.json")
    src.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its latest checkpoint")
    p.add_argument("--out", metavar="RUN_DIR", help="a new run directory (with --recipe or --config)")
    _add_override_args(p)


def _add_override_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. rollout.max_turns=10 (repeatable)")
    p.add_argument("pairs", nargs="*", default=[], metavar="KEY=VALUE", help="overrides as bare key=value, like --set")


def overrides_of(args: argparse.Namespace) -> list[str]:
    """``--set`` values, then bare ``key=value`` arguments (applied in that order)."""
    bare = list(getattr(args, "pairs", []) or [])
    bad = [a for a in bare if "=" not in a]
    if bad:
        raise ValueError(f"unexpected argument {bad[0]!r} (overrides are key=value)")
    return list(args.overrides) + bare


def fresh_config(args: argparse.Namespace):
    """The config of a new run: ``--recipe`` or ``--config`` with the overrides on top."""
    from megatron_tir.train.config import apply_overrides
    from megatron_tir.train.recipes import load_recipe
    from megatron_tir.train.config_file import load_config_file

    base = load_recipe(args.recipe) if args.recipe is not None else load_config_file(args.config)
    return apply_overrides(base, overrides_of(args))


class RunFinished(Exception):
    """``--resume`` of a run that has done all its steps (exit 0: a requeued job of a finished run ends cleanly)."""


def prepare(args: argparse.Namespace):
    """(config, run dir, trainer state, overrides to record) from the arguments; ValueError on bad input."""
    from megatron_tir.train.checkpoint import STATE, TrainerState
    from megatron_tir.train.config import apply_overrides, from_dict, to_dict
    from megatron_tir.train.preflight import check_resume, check_start

    overrides = overrides_of(args)

    def update(recorded):  # a resume: the overrides on the run's config, each change logged
        cfg = apply_overrides(recorded, overrides)
        if rank() == 0:
            for line in config_changes(to_dict(recorded), to_dict(cfg)):
                log.info("resume %s: %s", Path(args.resume), line)
        return cfg

    run_dir, cfg, _, reused = open_run_dir(
        args.out, args.resume, fresh=lambda: fresh_config(args), parse=from_dict, update=update,
        run_entries=RUN_ENTRIES, launcher_entries=LAUNCHER_ENTRIES,
        needs_out=f"{'--recipe' if args.recipe is not None else '--config'} needs --out RUN_DIR",
        out_on_resume="--out is only used with --recipe or --config (a resumed run stays in its directory)",
        no_checkpoint="--resume {run_dir}: the run has no checkpoint yet (a directory without one is reused by "
                      "--recipe NAME --out {run_dir}, which starts it fresh)")
    if reused:
        log.warning("--out %s: reusing a run directory that holds no checkpoint; the run starts fresh", run_dir)
    state = TrainerState()
    if args.resume is not None:
        latest = check_resume(run_dir, cfg)  # before anything slow (megatron_tir.train.preflight)
        state = TrainerState(**json.loads((latest / STATE).read_text()))
    check_start(cfg)  # model, layout, data: before anything slow starts (megatron_tir.train.preflight)
    if args.resume is not None and cfg.trainer.steps == state.step:
        raise RunFinished(f"{run_dir} has done all its {state.step} steps: nothing to do (continue it with "
                          f"--set trainer.steps=N)")
    if cfg.trainer.steps <= state.step:
        raise ValueError(f"trainer.steps={cfg.trainer.steps} but the run has done {state.step} steps already")
    recorded = [{"step": state.step + 1, "key": k, "value": v}
                for k, _, v in (o.partition("=") for o in overrides)]
    state.overrides = state.overrides + recorded
    state.config = to_dict(cfg)
    return cfg, run_dir, state


def _flat(mapping: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in mapping.items():
        if isinstance(value, dict):
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[prefix + key] = value
    return out


def config_changes(before: dict, after: dict) -> list[str]:
    """``key old -> new`` for every key whose value differs between two config dicts (``to_dict``), in
    the config's order; what a resume with ``--set`` changed (``rollout.max_turns 2 -> 10``)."""
    old, new = _flat(before), _flat(after)
    return [f"{key} {json.dumps(old.get(key))} -> {json.dumps(value)}" for key, value in new.items()
            if old.get(key) != value]


def run_train_command(args: argparse.Namespace) -> int:
    """Bad input (config, data, paths) is found by ``prepare``: ValueError, one line, exit 2, said by rank 0
    alone under torchrun; at the default level the INFO lines are rank 0's
    (:func:`megatron_tir.observe.ranks.run_on_every_rank`). Once the run has started, an engine or sandbox
    failure or a stop (``InfrastructureError``) is one line, exit 1; non-finite training likewise; anything
    else is exit 1 with its traceback in the log (not "bad input")."""
    return run_on_every_rank(_run_train, args)


def _run_train(args: argparse.Namespace) -> int:
    from megatron_tir.finite import NonFiniteTraining
    from megatron_tir.malloc import tune_malloc
    from megatron_tir.rollout.factory import InfrastructureError
    from megatron_tir.train.run import run_training

    tune_malloc()  # freed tensor memory goes back to the system (a fixed mmap threshold: megatron_tir.malloc)
    try:
        cfg, run_dir, state = prepare(args)
    except RunFinished as done:  # a requeued job of a finished run (the sbatch resumes when there is a checkpoint)
        if rank() == 0:
            print(f"megatron-tir: {done}")
        return 0
    if rank() == 0 and (note := load_note()):
        log.warning("%s", note)
    try:
        state = run_training(cfg, run_dir, state, resume=args.resume is not None)
    except InfrastructureError:
        raise
    except NonFiniteTraining as exc:  # every rank stops alike: rank 0 says it (stopped_on_every_rank)
        return stopped_on_every_rank(exc)
    except Exception:  # noqa: BLE001 - a defect or an environment problem mid-run, not the user's input
        log.exception("training failed at rank %d", rank())
        return 1
    if rank() == 0:
        print(f"trained to step {state.step}: {run_dir} (metrics: {run_dir / 'metrics.jsonl'})")
        for line in held_out_summary(run_dir / "metrics.jsonl"):
            print(line)
    return 0


def load_note(load: float | None = None, cores: int | None = None) -> str | None:
    """A warning when the machine is busier than its cores (1-minute load average above the core count):
    every phase then runs slower than on an idle machine, and the README's timings do not hold."""
    load = os.getloadavg()[0] if load is None else load
    cores = (os.cpu_count() or 1) if cores is None else cores
    if load <= cores:
        return None
    return (f"this machine is loaded (load average {load:.1f} on {cores} cores): phases take longer than on idle "
            f"cores, the README's timings do not hold; heartbeat lines show progress in a log file")


def held_out_summary(metrics_path: Path) -> list[str]:
    """One line per held-out evaluation in the run's metrics: step, reward, code use."""
    lines = []
    with open(metrics_path) as f:
        for raw in f:
            row = json.loads(raw)
            if "eval/reward" in row:
                lines.append(f"held-out at step {row['step']}: reward {row['eval/reward']:.3f}, "
                             f"code_use_ratio {row.get('eval/code_use_ratio', float('nan')):.3f}")
    return lines


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipe", required=True, metavar="NAME",
                   help=f"the recipe whose resolved config is printed: {_recipe_names()}")
    p.add_argument("--explain", action="store_true",
                   help="a comment above every key: its meaning and its default (still a valid config file)")
    _add_override_args(p)


def run_config_command(args: argparse.Namespace) -> int:
    """Print a recipe's resolved config (with the overrides) as YAML, for ``train --config``."""
    from megatron_tir.train.config import apply_overrides
    from megatron_tir.train.recipes import load_recipe
    from megatron_tir.train.config_file import dump_yaml

    cfg = apply_overrides(load_recipe(args.recipe), overrides_of(args))
    source = f"recipe {args.recipe}" + "".join(f" {o}" for o in overrides_of(args))
    if args.explain:
        from megatron_tir.train.config_reference import explain_yaml

        sys.stdout.write(explain_yaml(cfg, source=source))
    else:
        sys.stdout.write(dump_yaml(cfg, source=source))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``train`` and ``config`` to the ``megatron-tir`` subcommands (``plot``: :mod:`megatron_tir.observe.cli`)."""
    for name, help_text, add_args, func in (
            ("train", "GRPO training with multi-turn TIR rollouts (recipes, config files, --set overrides, --resume)",
             add_train_args, run_train_command),
            ("config", "print a recipe's resolved config as YAML (edit it, then train --config FILE)",
             add_config_args, run_config_command)):
        p = sub.add_parser(name, help=help_text, description=help_text, epilog=_config_epilog(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        add_args(p)
        p.set_defaults(func=func)

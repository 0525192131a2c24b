"""The run directory of a command that starts a run (``--out RUN_DIR``) or continues one (``--resume RUN_DIR``):
``megatron-tir train`` and ``megatron-tir sft``. The checks are the same; each command says what its runs write
into a directory, how its config is read and how it words the refusals that differ.

A new run's ``--out`` is new, or a run directory without a checkpoint (a start that failed or stopped before its
first save: it is reused and the run starts fresh), or holds only what a launcher put there. A resumed run has
its ``config.json`` and at least one complete checkpoint; the overrides apply on top of the recorded config.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Generic, NamedTuple, TypeVar

CONFIG_FILE = "config.json"
CHECKPOINTS_DIR = "checkpoints"
# what a run of either command (train, sft) writes into its directory, the trackers' files included (a directory
# holding only these, and the command's own entries, and no checkpoint can be reused)
RUN_ENTRIES = (CONFIG_FILE, "metrics.jsonl", "tb", CHECKPOINTS_DIR, "plots", "train.log", "wandb", "mlruns",
               "wandb_run_id", "mlflow_run_id")

C = TypeVar("C")


class OpenedRun(NamedTuple, Generic[C]):
    run_dir: Path
    config: C
    checkpoints: list[Path]  # --resume: the run's complete checkpoints, newest first; a new run: []
    reused: bool  # a new run whose --out already holds what a run writes (no checkpoint): it starts fresh


def open_run_dir(out: str | None, resume: str | None, *, fresh: Callable[[], C], parse: Callable[[dict], C],
                 update: Callable[[C], C], run_entries: Collection[str], launcher_entries: Collection[str] = (),
                 needs_out: str, out_on_resume: str, bad_config: str = "{path}: {exc}",
                 no_checkpoint: str = "--resume {run_dir}: the run has no checkpoint yet") -> OpenedRun[C]:
    """A new run (``resume`` is None): ``fresh()`` in ``out``; a resumed one: ``update(parse(config.json))``.

    ``run_entries``: what the command's runs write into their directory; ``launcher_entries``: what a launcher
    writes there before the run starts (neither makes ``--out`` foreign). The refusals (ValueError, one line):
    ``needs_out`` (a new run without ``--out``), ``out_on_resume`` (``--out`` with ``--resume``), ``bad_config``
    (a ``config.json`` that ``parse`` refuses: ``{path}``, ``{exc}``), ``no_checkpoint`` (``{run_dir}``)."""
    from megatron_tir.train import checkpoint_integrity as integrity

    if resume is None:
        if not out:
            raise ValueError(needs_out)
        run_dir = Path(out)
        reused = _check_out_dir(run_dir, run_entries, launcher_entries)
        return OpenedRun(run_dir, fresh(), [], reused)
    if out:
        raise ValueError(out_on_resume)
    run_dir = Path(resume)
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"--resume {run_dir}: no {CONFIG_FILE} (not a run directory)")
    try:
        cfg = parse(json.loads(path.read_text()))
    except (ValueError, TypeError) as exc:
        raise ValueError(bad_config.format(path=path, exc=exc)) from None
    cfg = update(cfg)
    found = integrity.candidates(run_dir / CHECKPOINTS_DIR)
    if not found:
        raise ValueError(no_checkpoint.format(run_dir=run_dir))
    return OpenedRun(run_dir, cfg, found, False)


def _check_out_dir(run_dir: Path, run_entries: Collection[str], launcher_entries: Collection[str]) -> bool:
    """Whether ``--out`` is reused (it holds run files but no checkpoint); ValueError when it cannot be used."""
    from megatron_tir.train import checkpoint_integrity as integrity

    if not run_dir.exists():
        return False
    if not run_dir.is_dir():
        raise ValueError(f"--out {run_dir} exists and is not a directory")
    if integrity.candidates(run_dir / CHECKPOINTS_DIR):
        raise ValueError(f"--out {run_dir} holds a run with checkpoints (continue it with --resume {run_dir})")
    entries = {p.name for p in run_dir.iterdir()}
    foreign = sorted(entries - set(launcher_entries) - set(run_entries))
    if foreign:
        raise ValueError(f"--out {run_dir} exists and is not a run directory (it holds {', '.join(foreign[:3])})")
    return bool(entries - set(launcher_entries))

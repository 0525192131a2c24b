"""Run checkpoints: each named learner's checkpoint plus the trainer's state, saved atomically.

Layout of ``RUN_DIR/checkpoints`` (documented once, with the policy checkpoint's own layout,
in ``megatron_tir.policy.checkpoint.layout``)::

    step_N/policy/           the policy learner: a policy checkpoint (``learner_io.save_learner``:
                             model + optimizer + scheduler; every rank writes its part), the layout
                             ``tir-ckpt`` reads; later learners (``critic``) sit beside it by name
    step_N/trainer_state.json  step, data position, metrics pointer, override history, resolved config
    step_N/rng_rank{R}.pt    python / torch RNG states of rank R
    latest                   a text file naming the newest complete step directory

A save writes everything into ``.tmp-step_N`` and makes it visible with one ``rename`` after
every file and directory is fsynced; ``latest`` is then replaced atomically (temp file,
fsync, ``os.replace``). A process killed at any moment leaves the previous checkpoint
complete and ``latest`` naming it; leftover ``.tmp-*`` directories are removed by the next
save. ``keep_last`` newest checkpoints are kept, older ones pruned.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_tir.policy.checkpoint.layout import CHECKPOINTS_DIR, LATEST, STEP_PREFIX, latest_step
from megatron_tir.policy.checkpoint.layout import TRAINER_STATE as STATE

log = logging.getLogger(__name__)

_LEARNER_NAME = re.compile(r"[a-z][a-z0-9_]*")


@dataclass(kw_only=True, slots=True)
class TrainerState:
    step: int = 0  # steps completed
    data_position: int = 0  # prompts drawn from the training stream
    metrics_offset: int = 0  # bytes of metrics.jsonl written when the state was saved
    overrides: list[dict] = field(default_factory=list)  # {"step", "key", "value"}: when each took effect
    schedule_switched_at: int | None = None  # step the turn schedule switched the budgets
    config: dict = field(default_factory=dict)  # the resolved TrainConfig

    def to_json(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}


def _fsync_tree(path: Path) -> None:
    for root, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(root))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rank() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _barrier() -> None:
    if _rank()[1] > 1:
        torch.distributed.barrier()


def _broadcast_path(path: Path | None) -> Path | None:
    """Rank 0's ``path`` on every rank."""
    if _rank()[1] == 1:
        return path
    obj = [None if path is None else str(path)]
    torch.distributed.broadcast_object_list(obj, src=0)
    return None if obj[0] is None else Path(obj[0])


def rng_state() -> dict:
    return {"python": random.getstate(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])


def _check_learners(learners: Mapping) -> None:
    if not isinstance(learners, Mapping) or not learners:
        raise ValueError("run checkpoints take the learners by name, e.g. {'policy': learner}")
    for name in learners:
        if not isinstance(name, str) or not _LEARNER_NAME.fullmatch(name):
            raise ValueError(f"learner name {name!r} must be lower-case letters, digits and _")


class RunCheckpoints:
    """Saves and finds the run checkpoints of ``run_dir`` (every rank calls save/load together).

    ``save_learner(learner, dir)`` / ``load_learner(learner, dir)`` write and read one learner's
    checkpoint; by default ``megatron_tir.policy.checkpoint.learner_io``'s."""

    def __init__(self, run_dir: str | os.PathLike, *, keep_last: int,
                 save_learner: Callable | None = None, load_learner: Callable | None = None) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.dir = Path(run_dir) / CHECKPOINTS_DIR
        self.keep_last = keep_last
        if save_learner is None or load_learner is None:
            from megatron_tir.policy.checkpoint import learner_io

            save_learner = save_learner or learner_io.save_learner
            load_learner = load_learner or learner_io.load_learner
        self._save_learner, self._load_learner = save_learner, load_learner

    def latest(self) -> Path | None:
        """The newest complete checkpoint directory, or None."""
        return latest_step(self.dir.parent)

    def save(self, learners: Mapping, state: TrainerState) -> Path:
        """Save every learner of ``learners`` (name -> learner) and ``state`` as ``step_N``."""
        _check_learners(learners)
        rank, _ = _rank()
        final = self.dir / f"{STEP_PREFIX}{state.step}"
        tmp = self.dir / f".tmp-{STEP_PREFIX}{state.step}"
        if rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            for old in self.dir.glob(".tmp-*"):
                shutil.rmtree(old, ignore_errors=True)
            tmp.mkdir()
        _barrier()
        for name, learner in learners.items():
            self._save_learner(learner, tmp / name)
        torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
        _barrier()
        if rank == 0:
            (tmp / STATE).write_text(json.dumps(state.to_json(), indent=1))
            _fsync_tree(tmp)
            if final.exists():  # the same step saved again (a rerun after a resume): replace it
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(self.dir)
            pointer_tmp = self.dir / f".{LATEST}.tmp"
            with open(pointer_tmp, "w") as f:
                f.write(final.name)
                f.flush()
                os.fsync(f.fileno())
            os.replace(pointer_tmp, self.dir / LATEST)
            _fsync_dir(self.dir)
            self._prune(keep=final)
            log.info("saved run checkpoint %s", final)
        _barrier()
        return final

    def _prune(self, *, keep: Path) -> None:
        steps = sorted((p for p in self.dir.glob(f"{STEP_PREFIX}*") if p.is_dir()),
                       key=lambda p: int(p.name.removeprefix(STEP_PREFIX)))
        for old in steps[:-self.keep_last]:
            if old != keep:
                shutil.rmtree(old, ignore_errors=True)

    def load(self, learners: Mapping, path: Path | None = None) -> TrainerState:
        """Restore each of ``learners`` (by name) and this rank's RNG from ``path`` (default: latest);
        the trainer state."""
        _check_learners(learners)
        rank, _ = _rank()
        path = _broadcast_path((path or self.latest()) if rank == 0 else None)
        if path is None or not (path / STATE).is_file():
            raise ValueError(f"no complete checkpoint in {self.dir}")
        missing = [name for name in learners if not (path / name).is_dir()]
        if missing:
            raise ValueError(f"checkpoint {path} has no learner {missing[0]!r} "
                             f"(it holds: {', '.join(sorted(p.name for p in path.iterdir() if p.is_dir()))})")
        for name, learner in learners.items():
            self._load_learner(learner, path / name)
        rng = path / f"rng_rank{rank}.pt"
        if rng.is_file():  # absent when the world size changed: RNG streams start fresh
            set_rng_state(torch.load(rng, weights_only=False))
        data = json.loads((path / STATE).read_text())
        return TrainerState(**data)

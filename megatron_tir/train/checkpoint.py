"""Run checkpoints: each named learner's checkpoint plus the trainer's state, saved atomically.

Layout of ``RUN_DIR/checkpoints`` (documented once, with the policy checkpoint's own layout,
in ``megatron_tir.policy.checkpoint.layout``)::

    step_N/policy/           the policy learner: a policy checkpoint (``learner_io.save_learner``:
                             model + optimizer + scheduler; every rank writes its part), the layout
                             ``tir-ckpt`` reads; later learners (``critic``) sit beside it by name
    step_N/trainer_state.json  step, data position, metrics pointer, override history, the grad-norm
                             statistics' window, the engine's weight version, resolved config
    step_N/rng_rank{R}.pt    python / torch RNG states of rank R
    step_N/manifest.json     size and CRC-32 of every file above (``megatron_tir.policy.checkpoint.manifest``)
    latest                   a text file naming the newest complete step directory

A save writes everything into ``.tmp-step_N`` and makes it visible with one ``rename`` after
every file and directory is fsynced; ``latest`` is then replaced atomically (temp file,
fsync, ``os.replace``). A process killed at any moment leaves the previous checkpoint
complete and ``latest`` naming it; leftover ``.tmp-*`` directories are removed by the next
save. ``keep_last`` newest checkpoints are kept, older ones pruned.

Integrity: the dist writer hashes the learners' files while writing them and the manifest
is written before the rename; a model with non-finite weights is never saved. ``load``
verifies every byte (the ranks share the reading) and falls back to the newest intact
checkpoint, warning with the damaged file's name (``strict``: it refuses instead). A save
that runs out of disk raises one line with the space it needs, after removing its partial
directory (``checkpoint_integrity``).
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

from megatron_tir.policy.checkpoint import manifest
from megatron_tir.policy.checkpoint.layout import CHECKPOINTS_DIR, LATEST, STEP_PREFIX, latest_step
from megatron_tir.policy.checkpoint.layout import TRAINER_STATE as STATE
from megatron_tir.train import checkpoint_integrity as integrity

log = logging.getLogger(__name__)

_LEARNER_NAME = re.compile(r"[a-z][a-z0-9_]*")


@dataclass(kw_only=True, slots=True)
class TrainerState:
    step: int = 0  # steps completed
    data_position: int = 0  # prompts drawn from the training stream (trainer.async=full: the first not consumed)
    data_consumed_ahead: list[int] = field(default_factory=list)  # full: positions past it already consumed
    metrics_offset: int = 0  # bytes of metrics.jsonl written when the state was saved
    overrides: list[dict] = field(default_factory=list)  # {"step", "key", "value"}: when each took effect
    schedule_switched_at: int | None = None  # step the turn schedule switched the budgets
    grad_norm_history: list[float] = field(default_factory=list)  # the grad-norm spike detector's window (rank 0)
    weight_version: int = 0  # the engine's weight version (rank 0's): a resume continues the numbering
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


def _broadcast_obj(obj):
    """Rank 0's ``obj`` (picklable) on every rank."""
    if _rank()[1] == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _gather_dicts(mine: dict) -> dict:
    """The union of every rank's ``mine``, on every rank."""
    if _rank()[1] == 1:
        return dict(mine)
    parts: list = [None] * _rank()[1]
    torch.distributed.all_gather_object(parts, dict(mine))
    return {k: v for part in parts for k, v in part.items()}


def _gather_list(obj) -> list:
    """Every rank's ``obj``, in rank order, on every rank."""
    if _rank()[1] == 1:
        return [obj]
    parts: list = [None] * _rank()[1]
    torch.distributed.all_gather_object(parts, obj)
    return parts


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

    def save(self, learners: Mapping, state: TrainerState) -> Path | None:
        """Save every learner of ``learners`` (name -> learner) and ``state`` as ``step_N``, with a manifest
        of its files; None (nothing written) when a learner's weights are not finite."""
        _check_learners(learners)
        rank, _ = _rank()
        final = self.dir / f"{STEP_PREFIX}{state.step}"
        tmp = self.dir / f".tmp-{STEP_PREFIX}{state.step}"
        for name, learner in learners.items():
            finite = getattr(learner, "weights_finite", None)
            if finite is not None and not finite():  # collective; a non-finite model is never saved
                log.error("step %d: the weights of %s are not finite: no checkpoint saved (the newest stays %s)",
                          state.step, name, (self.latest() or self.dir).name)
                return None
        previous = next(iter(integrity.candidates(self.dir)), None) if rank == 0 else None
        if rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            for old in self.dir.glob(".tmp-*"):
                shutil.rmtree(old, ignore_errors=True)
            tmp.mkdir()
        _barrier()
        try:
            with manifest.recording() as recorded:  # the dist writer hashes what it writes
                for name, learner in learners.items():
                    self._save_learner(learner, tmp / name)
                torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
            recorded = _gather_dicts(recorded)
            _barrier()
            if rank == 0:
                (tmp / STATE).write_text(json.dumps(state.to_json(), indent=1))
                manifest.write_manifest(tmp, recorded)
                _fsync_tree(tmp)
        except BaseException as exc:  # (torch's CheckpointException is a BaseException)
            if rank == 0:
                full = integrity.disk_full(exc, partial=tmp, target=final, previous=previous)
                shutil.rmtree(tmp, ignore_errors=True)
                if full is not None:
                    raise full from None
            raise
        if rank == 0:
            if final.exists():  # the same step saved again (a rerun after a resume skipped it): keep the evidence
                integrity.set_aside(final, f"step {state.step} is saved again")
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
        steps = sorted((p for p in self.dir.glob(f"{STEP_PREFIX}*")  # (step_N.damaged are kept: evidence)
                        if p.is_dir() and p.name.removeprefix(STEP_PREFIX).isdigit()),
                       key=lambda p: int(p.name.removeprefix(STEP_PREFIX)))
        for old in steps[:-self.keep_last]:
            if old != keep:
                shutil.rmtree(old, ignore_errors=True)

    def load(self, learners: Mapping, path: Path | None = None, *, strict: bool = False,
             allow_unverified: bool = False) -> TrainerState:
        """Restore each of ``learners`` (by name) and this rank's RNG from ``path`` (default: the newest
        intact checkpoint: a damaged one -- against its manifest, without one where the run's others have
        one, or holding a non-finite weight or optimizer tensor -- is skipped with a warning naming the
        file and renamed ``step_N.damaged``, or refused when ``strict``); the trainer state. A run without
        any manifest loads only with ``allow_unverified``."""
        _check_learners(learners)
        rank, world = _rank()
        found = [path] if path is not None else integrity.candidates(self.dir)
        if rank == 0 and path is None:
            integrity.report_latest(self.dir, found)
        required = integrity.manifest_required(found, allow_unverified=allow_unverified) if rank == 0 else True
        found, required = _broadcast_obj((found, required))  # rank 0's view
        if not found or not (found[0] / STATE).is_file():
            raise ValueError(f"no complete checkpoint in {self.dir}")
        skipped: list[tuple[Path, str]] = []
        for i, path in enumerate(found):
            # every byte read once: each rank hashes its share of the files
            whys = _gather_list(integrity.problem(path, deep=True, part=(rank, world), required=required))
            why = next((w for w in whys if w is not None), None)
            if why is None:
                missing = [name for name in learners if not (path / name).is_dir()]
                if missing:
                    raise ValueError(f"checkpoint {path} has no learner {missing[0]!r} (it holds: "
                                     f"{', '.join(sorted(p.name for p in path.iterdir() if p.is_dir()))})")
                from megatron_tir.policy.checkpoint.learner_io import first_nonfinite

                for name, learner in learners.items():
                    self._load_learner(learner, path / name)
                    bad = first_nonfinite(learner) if hasattr(learner, "module") else None  # collective
                    if bad is None and getattr(learner, "weights_finite", None) is not None \
                            and not learner.weights_finite():
                        bad = "a weight"
                    if bad is not None:
                        why = f"checkpoint {path}: {name} holds non-finite values ({bad})"
                        break
            if why is None:
                break
            integrity.refuse(why, strict=strict)
            skipped.append((path, why))
            if i == len(found) - 1:
                raise ValueError(f"no intact checkpoint in {self.dir} (the oldest: {why})")
        if rank == 0:  # resuming from an older step: the evidence stays, the rerun steps cannot overwrite it
            for damaged, why in skipped:
                integrity.set_aside(damaged, why)
        _barrier()
        rng = path / f"rng_rank{rank}.pt"
        if rng.is_file():  # absent when the world size changed: RNG streams start fresh
            set_rng_state(torch.load(rng, weights_only=False))
        data = json.loads((path / STATE).read_text())
        return TrainerState(**data)

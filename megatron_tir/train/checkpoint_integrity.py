"""Which run checkpoint to resume from, and what a save that runs out of disk says.

* :func:`candidates`: the complete step directories (``trainer_state.json`` present), newest first.
* :func:`problem`: why a step directory cannot be resumed from -- a file missing, truncated or
  damaged against its ``manifest.json`` (:mod:`megatron_tir.policy.checkpoint.manifest`), or an
  unreadable trainer state -- in one line naming the file; None when it is intact. ``deep=False``
  checks sizes only (a stat per file: what every rank can afford before the slow start);
  ``deep=True`` checks every byte (once, shared by the ranks, before the learners read it).
* :func:`pick`: the newest intact one; a damaged one is skipped with a warning naming it, or,
  ``strict``, refused (``trainer.checkpoint.strict_resume``).
* A step without ``manifest.json`` in a run whose other steps have one lost it: it is damaged. A
  run without any manifest (written before manifests existed) is resumed unverified only with
  ``trainer.checkpoint.allow_unverified=true`` (:func:`manifest_required`).
* :func:`set_aside`: a damaged step skipped by a resume is renamed ``step_N.damaged`` (the evidence
  stays; the rerun step cannot overwrite it); :func:`report_latest`: a ``latest`` pointer naming a
  step that is missing or incomplete is reported, not silently ignored.
* :class:`DiskFullError`: a save that found no space: the path, the space it needs and the free
  space, in one line (the partial directory is removed by the caller, the previous checkpoint is
  untouched).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from pathlib import Path

from megatron_tir.policy.checkpoint import manifest
from megatron_tir.policy.checkpoint.layout import LATEST, STEP_PREFIX
from megatron_tir.policy.checkpoint.layout import TRAINER_STATE as STATE

log = logging.getLogger(__name__)

DAMAGED_SUFFIX = ".damaged"  # step_N.damaged: a damaged step a resume skipped


class DiskFullError(ValueError):
    """No space for a run checkpoint (one line; a ValueError so the CLI prints it as such, exit 2)."""


def candidates(ckpt_dir: Path) -> list[Path]:
    """Complete step directories of ``RUN_DIR/checkpoints``, newest first."""
    steps = []
    for p in Path(ckpt_dir).glob(f"{STEP_PREFIX}*"):
        number = p.name.removeprefix(STEP_PREFIX)
        if number.isdigit() and (p / STATE).is_file():
            steps.append((int(number), p))
    return [p for _, p in sorted(steps, reverse=True)]


def manifest_required(found: list[Path], *, allow_unverified: bool) -> bool:
    """Whether the steps ``found`` (one run's) must have a manifest: yes when any of them has one; a run
    without any (written before manifests existed) is refused unless ``allow_unverified`` (ValueError)."""
    if any(manifest.has_manifest(p) for p in found):
        return True
    if found and not allow_unverified:
        raise ValueError(f"no checkpoint of {found[0].parent} has a {manifest.MANIFEST} (written before manifests "
                         f"existed): its files cannot be verified; resume it unverified with "
                         f"--set trainer.checkpoint.allow_unverified=true")
    if found:
        log.warning("resuming %s without verification (trainer.checkpoint.allow_unverified=true: no checkpoint "
                    "of the run has a %s)", found[0].parent, manifest.MANIFEST)
    return False


def report_latest(ckpt_dir: Path, found: list[Path]) -> None:
    """Warn when ``ckpt_dir/latest`` names a step directory that is missing or incomplete."""
    pointer = Path(ckpt_dir) / LATEST
    if not pointer.is_file():
        return
    try:
        name = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        log.warning("%s is unreadable (%s); the newest complete step is %s", pointer, exc,
                    found[0].name if found else "none")
        return
    if not any(p.name == name for p in found):
        what = "does not exist" if not (pointer.parent / name).exists() else "is not a complete checkpoint"
        log.warning("%s names %s, which %s; the newest complete step is %s", pointer, name, what,
                    found[0].name if found else "none")


def set_aside(step_dir: Path, why: str) -> Path:
    """Rename the damaged ``step_dir`` to ``step_N.damaged`` (``.damaged.K`` when taken) and say so."""
    step_dir = Path(step_dir)
    target = step_dir.with_name(f"{step_dir.name}{DAMAGED_SUFFIX}")
    k = 1
    while target.exists():
        k += 1
        target = step_dir.with_name(f"{step_dir.name}{DAMAGED_SUFFIX}.{k}")
    os.rename(step_dir, target)
    log.warning("renamed the damaged checkpoint %s to %s (%s)", step_dir.name, target.name, why)
    return target


def problem(step_dir: Path, *, deep: bool, part: tuple[int, int] = (0, 1), required: bool = True) -> str | None:
    """One line naming what is wrong with ``step_dir``, or None when it is intact (``part``: this rank's
    share of the files to hash, see ``manifest.verify``; ``required``: a missing manifest is damage)."""
    try:
        manifest.verify(step_dir, deep=deep, part=part, required=required)
    except manifest.ManifestError as exc:
        return str(exc)
    try:
        state = json.loads((step_dir / STATE).read_text())
        if not isinstance(state, dict) or not isinstance(state.get("step"), int):
            raise ValueError("no step")
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        return f"checkpoint {step_dir}: {STATE} is unreadable ({exc})"
    return None


def pick(ckpt_dir: Path, *, strict: bool, deep: bool, allow_unverified: bool = False) -> Path:
    """The newest intact step directory; ValueError when there is none, or (``strict``) when the newest is damaged."""
    found = candidates(ckpt_dir)
    if not found:
        raise ValueError(f"no complete checkpoint in {ckpt_dir}")
    report_latest(ckpt_dir, found)
    required = manifest_required(found, allow_unverified=allow_unverified)
    skipped = []
    for path in found:
        why = problem(path, deep=deep, required=required)
        if why is None:
            if skipped:
                log.warning("resuming from %s, skipped %s", path.name, "; ".join(skipped))
            return path
        refuse(why, strict=strict)
        skipped.append(why)
    raise ValueError(f"no intact checkpoint in {ckpt_dir}: {'; '.join(skipped)}")


def refuse(why: str, *, strict: bool) -> None:
    """Raise for a damaged checkpoint under ``strict``; else warn that it is skipped."""
    if strict:
        raise manifest.ManifestError(f"{why} (trainer.checkpoint.strict_resume=true: not falling back to an "
                                     f"older checkpoint)")
    log.warning("skipping damaged checkpoint: %s", why)


def tree_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def _no_space(exc: BaseException) -> bool:
    seen = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        todo += [e.__cause__, e.__context__]
        for failure in (getattr(e, "failures", None) or {}).values():  # CheckpointException: rank -> (exc, tb)
            todo += [f for f in (failure if isinstance(failure, tuple) else (failure,)) if isinstance(f, BaseException)]
    return False


def disk_full(exc: BaseException, *, partial: Path, target: Path, previous: Path | None) -> DiskFullError | None:
    """A :class:`DiskFullError` when ``exc``, raised while ``partial`` was being written (call this before
    removing it), means the disk is full: ENOSPC/EDQUOT in its chain, or almost no free space left
    (torch's zip writer turns a short write into ``unexpected pos``, without the errno)."""
    free = shutil.disk_usage(partial if partial.exists() else partial.parent).free
    if not (_no_space(exc) or free < (4 << 20)):
        return None
    written = tree_bytes(partial)
    needed = tree_bytes(previous) if previous is not None else 0
    what = (f"about {needed / 2**20:.1f} MiB (the size of {previous.name})" if needed > written
            else f"more than the {written / 2**20:.1f} MiB written before the disk filled")
    return DiskFullError(f"no space left on device for checkpoint {target}: it needs {what}, "
                         f"{(free + written) / 2**20:.1f} MiB are free without it (the partial checkpoint "
                         f"is removed, the previous one is intact)")

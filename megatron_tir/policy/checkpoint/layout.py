"""The on-disk layout of the checkpoints this project writes and reads: one layout.

A **policy checkpoint** (a ``tir-ckpt hf-to-megatron`` output, or one learner of a run
checkpoint)::

    <ckpt>/                      # e.g. RUN_DIR/checkpoints/step_100/policy/
      tir_ckpt.json              # CheckpointMeta (below): format, model spec, HF config, layout, iteration
      hf/                        # HF config.json, generation_config.json, tokenizer files (no weights)
      .metadata, *.distcp,       # ONE megatron.core.dist_checkpointing checkpoint (torch_dist format);
      common.pt, metadata.json   #   model tensors under sharded keys "model.<megatron-core sharded key>",
                                 #   e.g. model.decoder.layers.self_attention.linear_qkv.weight [L, ...];
                                 #   a learner's adds "optimizer.*" and the lr scheduler (common.pt).

A **run checkpoint** (``megatron_tir.train.checkpoint.RunCheckpoints``)::

    RUN_DIR/checkpoints/
      step_N/                    # one complete save (written as .tmp-step_N, renamed when complete)
        policy/                  #   the policy learner: a policy checkpoint (above)
        <name>/                  #   any other named learner (a critic), same layout
        trainer_state.json       #   step, data position, ... (the trainer's state)
        rng_rank{R}.pt           #   RNG states of rank R
      latest                     # a text file naming the newest complete step_N

``resolve_checkpoint`` accepts all three levels: a policy checkpoint, a step directory
(-> its ``policy``) and a run directory (-> the ``policy`` of the step ``latest`` names).
The torch_dist format stores global tensors, so any TP/PP loads it; ``tp``/``pp`` in the
metadata record how it was written.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from megatron_tir.policy.checkpoint.hf_io import WEIGHT_SUFFIXES, INDEX_NAME
from megatron_tir.policy.spec import ModelSpec

META_NAME = "tir_ckpt.json"
HF_FILES_DIR = "hf"
MODEL_PREFIX = "model."
FORMAT = "megatron-tir-checkpoint"
FORMAT_VERSION = 1
CHECKPOINTS_DIR = "checkpoints"  # RUN_DIR/checkpoints
LATEST = "latest"  # RUN_DIR/checkpoints/latest names the newest complete step directory
STEP_PREFIX = "step_"  # RUN_DIR/checkpoints/step_N
TRAINER_STATE = "trainer_state.json"  # in a step directory: it is complete
POLICY = "policy"  # the policy learner's checkpoint in a step directory
CRITIC = "critic"  # the critic's (trainer.ppo.advantage=gae), beside it


@dataclass(kw_only=True, slots=True)
class CheckpointMeta:
    """Contents of ``tir_ckpt.json``."""

    model_spec: dict
    hf_config: dict
    tp: int = 1
    pp: int = 1
    iteration: int | None = None
    source: str = ""
    format: str = FORMAT
    version: int = FORMAT_VERSION
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.format != FORMAT:
            raise ValueError(f"not a {FORMAT} metadata file (format={self.format!r})")
        if self.version > FORMAT_VERSION:
            raise ValueError(f"checkpoint format version {self.version} is newer than this tool ({FORMAT_VERSION})")
        if self.tp < 1 or self.pp < 1:
            raise ValueError(f"invalid layout tp={self.tp} pp={self.pp}")
        ModelSpec.from_dict(self.model_spec)  # validates

    @property
    def spec(self) -> ModelSpec:
        return ModelSpec.from_dict(self.model_spec)


def latest_step(run_dir: Path) -> Path | None:
    """The step directory ``RUN_DIR/checkpoints/latest`` names, or None when there is no pointer;
    ValueError when it names an incomplete one."""
    pointer = Path(run_dir) / CHECKPOINTS_DIR / LATEST
    if not pointer.is_file():
        return None
    path = pointer.parent / pointer.read_text().strip()
    if not (path / TRAINER_STATE).is_file():
        raise ValueError(f"{pointer} names {path.name}, which is not a complete checkpoint")
    return path


def is_run_dir(path: Path) -> bool:
    return (Path(path) / CHECKPOINTS_DIR).is_dir()


def is_step_dir(path: Path) -> bool:
    return (Path(path) / TRAINER_STATE).is_file()


def resolve_checkpoint(path: Path, *, learner: str = POLICY) -> Path:
    """A policy checkpoint dir; a step dir (-> its ``learner``); a run dir (-> the latest step's
    ``learner``); ValueError for anything else."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"checkpoint {path} does not exist")
    if (path / META_NAME).is_file():
        return path
    if is_run_dir(path):
        step = latest_step(path)
        if step is None:
            raise ValueError(f"run directory {path} has no complete checkpoint yet "
                             f"({CHECKPOINTS_DIR}/{LATEST} is missing)")
        path = step
    if is_step_dir(path):
        ckpt = path / learner
        if not (ckpt / META_NAME).is_file():
            raise ValueError(f"step checkpoint {path} has no {learner!r} learner checkpoint")
        return ckpt
    raise ValueError(f"{path} is not a checkpoint ({META_NAME} missing), a run checkpoint's step directory "
                     f"({TRAINER_STATE} missing) nor a run directory ({CHECKPOINTS_DIR}/ missing)")


def read_meta(ckpt: Path) -> CheckpointMeta:
    meta_path = Path(ckpt) / META_NAME
    if not meta_path.is_file():
        raise ValueError(f"{ckpt} is not a checkpoint: {META_NAME} is missing")
    try:
        meta = CheckpointMeta(**json.loads(meta_path.read_text()))
    except (json.JSONDecodeError, TypeError) as e:
        raise ValueError(f"{meta_path} is unreadable: {e}") from None
    if not (Path(ckpt) / ".metadata").is_file():
        raise ValueError(f"{ckpt} has no dist_checkpointing data (.metadata missing)")
    return meta


def write_meta(ckpt: Path, meta: CheckpointMeta) -> None:
    data = {name: getattr(meta, name) for name in CheckpointMeta.__slots__}
    (Path(ckpt) / META_NAME).write_text(json.dumps(data, indent=2, sort_keys=True))


def copy_hf_files(src_dir: Path, dst_dir: Path) -> None:
    """Copy config/tokenizer/generation files (everything but weights) from an HF dir."""
    dst_dir.mkdir(parents=True, exist_ok=True)
    for item in Path(src_dir).iterdir():
        if item.is_file() and not item.name.endswith(WEIGHT_SUFFIXES) and item.name != INDEX_NAME:
            shutil.copy2(item, dst_dir / item.name)


@contextmanager
def atomic_output_dir(out: Path):
    """Yield a fresh temp dir next to ``out``; rename it to ``out`` only if the block succeeds."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"output {out} already exists and is not empty")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

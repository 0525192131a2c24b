"""The on-disk layout of a Megatron checkpoint written or read by this project.

A checkpoint directory (a conversion output, or one iteration of a training run)::

    <ckpt>/                      # e.g. run_dir/checkpoints/iter_0000100/
      tir_ckpt.json              # CheckpointMeta (below): format, model spec, HF config, layout, iteration
      hf/                        # HF config.json, generation_config.json, tokenizer files (no weights)
      .metadata, *.distcp,       # ONE megatron.core.dist_checkpointing checkpoint (torch_dist format);
      common.pt, metadata.json   #   model tensors under sharded keys "model.<GPTModel key>", e.g.
                                 #   model.decoder.layers.self_attention.linear_qkv.weight [L, ...];
                                 #   the trainer may add "optimizer.*" / RNG keys to the same checkpoint.

A training run keeps ``run_dir/checkpoints/iter_{N:07d}/`` directories and a
``run_dir/checkpoints/latest_checkpointed_iteration.txt`` holding N. The trainer writes
the model with ``gpt_model.sharded_state_dict(prefix=MODEL_PREFIX)`` inside
``dist_checkpointing.save`` and then ``write_meta`` + ``copy_hf_files`` (rank 0). The
torch_dist format stores global tensors, so any TP/PP loads it; ``layout`` records how
it was written.
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
CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest_checkpointed_iteration.txt"


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


def iteration_dir(run_dir: Path, iteration: int) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR / f"iter_{iteration:07d}"


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint dir, or a run dir (-> its latest iteration); ValueError if neither."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"checkpoint {path} does not exist")
    if (path / META_NAME).is_file():
        return path
    ckpts = path / CHECKPOINTS_DIR
    if ckpts.is_dir():
        latest = ckpts / LATEST_FILE
        if latest.is_file():
            cand = iteration_dir(path, int(latest.read_text().strip()))
        else:
            iters = sorted(ckpts.glob("iter_*"))
            cand = iters[-1] if iters else None
        if cand is not None and (cand / META_NAME).is_file():
            return cand
    raise ValueError(f"{path} is not a checkpoint ({META_NAME} missing) nor a run directory with checkpoints/iter_*")


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

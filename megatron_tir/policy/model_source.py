"""Where a learner's weights come from: a named model, an HF directory or a run / policy checkpoint."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from megatron_tir.named_models import named_or_hf_dir
from megatron_tir.policy.checkpoint.layout import (HF_FILES_DIR, META_NAME, is_run_dir, is_step_dir, read_meta,
                                                   resolve_checkpoint)
from megatron_tir.policy.spec import ModelSpec, spec_from_hf_dir


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class ModelSource:
    """Where a learner's weights came from: the model, its HF config and files, the checkpoint (or None)."""

    spec: ModelSpec
    hf_config: dict
    hf_files: Path  # config + tokenizer (and, for an HF source, the weights)
    checkpoint: Path | None


def is_checkpoint(path: str | os.PathLike) -> bool:
    """True for a policy checkpoint, a run checkpoint's step directory or a run directory (which
    has a ``config.json`` of its own: the trainer's, not an HF config)."""
    path = Path(path)
    return path.is_dir() and ((path / META_NAME).is_file() or is_step_dir(path) or is_run_dir(path))


def resolve_source(model: str) -> ModelSource:
    """``model``: a checkpoint (its weights, by sharded keys), a named model or an HF directory
    (:func:`megatron_tir.named_models.named_or_hf_dir`)."""
    path = Path(model)
    if is_checkpoint(path):  # a policy checkpoint, a step or a run directory: its weights, by sharded keys
        ckpt = resolve_checkpoint(path)
        meta = read_meta(ckpt)
        return ModelSource(spec=meta.spec, hf_config=meta.hf_config, hf_files=ckpt / HF_FILES_DIR, checkpoint=ckpt)
    hf_dir = named_or_hf_dir(model)
    spec, config = spec_from_hf_dir(hf_dir)
    return ModelSource(spec=spec, hf_config=config, hf_files=hf_dir, checkpoint=None)

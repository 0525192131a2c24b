"""Where a learner's weights come from: a named model, an HF directory or a run / policy checkpoint."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from megatron_tir.policy.checkpoint.layout import HF_FILES_DIR, read_meta, resolve_checkpoint
from megatron_tir.policy.spec import ModelSpec, spec_from_hf_dir


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class ModelSource:
    """Where a learner's weights came from: the model, its HF config and files, the checkpoint (or None)."""

    spec: ModelSpec
    hf_config: dict
    hf_files: Path  # config + tokenizer (and, for an HF source, the weights)
    checkpoint: Path | None


def resolve_source(model: str) -> ModelSource:
    from megatron_tir.model_sources import is_checkpoint, resolve_model

    path = Path(model)
    if is_checkpoint(path):  # a policy checkpoint, a step or a run directory: its weights, by sharded keys
        ckpt = resolve_checkpoint(path)
        meta = read_meta(ckpt)
        return ModelSource(spec=meta.spec, hf_config=meta.hf_config, hf_files=ckpt / HF_FILES_DIR, checkpoint=ckpt)
    hf_dir = resolve_model(model)
    spec, config = spec_from_hf_dir(hf_dir)
    return ModelSource(spec=spec, hf_config=config, hf_files=hf_dir, checkpoint=None)

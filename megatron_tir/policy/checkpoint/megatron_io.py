"""Load a checkpoint into a live (parallel) GPTModel and save one from it.

These run on every rank of a TP x PP job and are what the trainer reuses: the model's
own ``sharded_state_dict(prefix=MODEL_PREFIX)`` says which slices this rank holds, and
``dist_checkpointing`` reads/writes exactly those, whatever layout wrote the checkpoint.

Either layer spec loads a checkpoint either spec wrote: the weights have the same sharded
keys (``keymap``), and Transformer Engine's ``_extra_state`` (FP8 metadata; the local spec
keeps empty ones on its linear layers for TE's sake) is read where the checkpoint has it and
otherwise left as the module made it (``model_state_dict``: a checkpoint converted on CPU has
no ``core_attention._extra_state``, which a TE model asks for).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from megatron_tir.policy.checkpoint.layout import (HF_FILES_DIR, MODEL_PREFIX, CheckpointMeta, copy_hf_files, write_meta)
from megatron_tir.policy.spec import ModelSpec

log = logging.getLogger(__name__)


def without_absent_extra_state(sharded: dict, ckpt: Path) -> dict:
    """``sharded`` less the ``_extra_state`` objects that the checkpoint ``ckpt`` does not hold."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    from megatron_tir.policy.keymap import is_extra_state

    extra = [k for k, v in sharded.items() if isinstance(v, ShardedObject) and is_extra_state(v.key)]
    if not extra:
        return sharded
    present = set(load_sharded_metadata(str(ckpt)))
    absent = {k for k in extra if sharded[k].unique_key not in present}  # keyed 'key/shard_<offset>_<shape>'
    if absent:
        log.info("%s: %d _extra_state entries absent (a checkpoint of the other layer spec): left as built",
                 ckpt, len(absent))
    return {k: v for k, v in sharded.items() if k not in absent}


def load_model_state(model, state: dict, ckpt: Path, *, skip: tuple[str, ...] = ()) -> None:
    """``model.load_state_dict(state)``, where only ``_extra_state`` entries (and ``skip``) may be missing."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in skip and not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"{ckpt}: the checkpoint does not fill the model (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]})")


def load_model(model, ckpt: Path, *, skip: tuple[str, ...] = ()) -> None:
    """Fill this rank's ``model`` (a GPTModel stage) from the dist checkpoint ``ckpt``; parameters
    named in ``skip`` (a critic's value head, when it starts from a policy) keep their values."""
    from megatron.core import dist_checkpointing

    sharded = {k: v for k, v in model.sharded_state_dict(prefix=MODEL_PREFIX).items()
               if k.removeprefix(MODEL_PREFIX) not in skip}
    sharded = without_absent_extra_state(sharded, Path(ckpt))
    loaded = dist_checkpointing.load(sharded, str(ckpt))
    # a learner checkpoint also holds optimizer/scheduler state: take the model's entries only
    state = {k.removeprefix(MODEL_PREFIX): loaded[k] for k in sharded}
    load_model_state(model, state, Path(ckpt), skip=skip)


def save_model(model, ckpt: Path, *, spec: ModelSpec, hf_config: dict, hf_files: Path | None,
               iteration: int | None = None, source: str = "") -> None:
    """Save this rank's ``model`` into ``ckpt`` (all ranks call this), then rank 0 writes the metadata."""
    from megatron.core import parallel_state

    from megatron_tir.policy.checkpoint.dist_writer import save_sharded

    ckpt = Path(ckpt)
    save_sharded(model.sharded_state_dict(prefix=MODEL_PREFIX), ckpt)  # torch_dist, written in this process
    if torch.distributed.get_rank() == 0:
        if hf_files is not None and Path(hf_files).is_dir():
            copy_hf_files(hf_files, ckpt / HF_FILES_DIR)
        write_meta(ckpt, CheckpointMeta(
            model_spec=spec.to_dict(), hf_config=hf_config, iteration=iteration, source=source,
            tp=parallel_state.get_tensor_model_parallel_world_size(),
            pp=parallel_state.get_pipeline_model_parallel_world_size()))
    torch.distributed.barrier()


def check_same_model(meta: CheckpointMeta, spec: ModelSpec, what: str) -> None:
    """ValueError unless ``spec`` describes the model in the checkpoint (dtype aside)."""
    a, b = meta.spec.to_dict(), spec.to_dict()
    diffs = [f"{k} {a[k]} vs {b[k]}" for k in a if k != "dtype" and a[k] != b[k]]
    if diffs:
        raise ValueError(f"checkpoint holds a different model than {what}: {', '.join(diffs[:3])}")

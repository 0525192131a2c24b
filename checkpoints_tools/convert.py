"""HF <-> Megatron conversion, tensor by tensor.

HF -> Megatron: the HF config gives a ``ModelSpec``; a GPTModel built on the meta device
(TP=1, PP=1: global shapes, no memory) gives the sharded-state-dict templates, i.e. the
exact keys, layer stacking and SwiGLU split megatron-core uses. ``dist_checkpointing.save``
(with ``dist_writer``'s in-process torch_dist writer) saves those templates, still meta
tensors, into a temp dir renamed at the end; each stored chunk is converted from the HF
tensors (read one at a time) at the moment it is written. Peak memory: about one tensor.

Megatron -> HF: ``megatron_tir.policy.checkpoint.export`` (megatron-core's sharded keys say
where each tensor lives; no model is built): each is read alone from the torch_dist files
(``dist_reader``, files kept open, chunks loaded in place) and written straight into a
streaming safetensors writer. Peak memory: one tensor.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch

from megatron_tir.policy import keymap
from megatron_tir.policy.checkpoint.hf_io import HFReader
from megatron_tir.policy.checkpoint.layout import (HF_FILES_DIR, MODEL_PREFIX, CheckpointMeta, atomic_output_dir,
                                      copy_hf_files, write_meta)
from megatron_tir.model_sources import resolve_model
from megatron_tir.policy.spec import ModelSpec, spec_from_hf_dir

log = logging.getLogger(__name__)


def _model_templates(spec: ModelSpec) -> dict:
    """The whole model's sharded state dict on meta tensors, keyed ``model.<local-spec GPTModel key>``
    whichever layer spec built it (the keys megatron-core saves under are the entries' own):
    ShardedTensor / ShardedTensorFactory per weight (checked against the key map) and
    ShardedObject per ``_extra_state`` (saved as they are)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from megatron_tir.policy.build import build_gpt_model
    from megatron_tir.policy.parallel import init_parallel

    init_parallel(1, 1)
    model = build_gpt_model(spec, meta=True, pre_process=True, post_process=True)
    sharded = {(k if isinstance(v, ShardedObject) else MODEL_PREFIX + keymap.local_name(k.removeprefix(MODEL_PREFIX))): v
               for k, v in model.sharded_state_dict(prefix=MODEL_PREFIX).items()}
    out = {k.removeprefix(MODEL_PREFIX): v for k, v in sharded.items() if not isinstance(v, ShardedObject)}
    expected = {p.megatron for p in keymap.plan(spec)}
    if set(out) != expected:  # the key map and megatron-core disagree: a bug or a megatron-core change
        raise AssertionError(f"key map mismatch: missing {sorted(expected - set(out))[:3]}, "
                             f"unmapped {sorted(set(out) - expected)[:3]}")
    return sharded


def _check_hf_tensors(reader: HFReader, spec: ModelSpec, plans: list[keymap.TensorPlan]) -> torch.dtype:
    """Every expected HF tensor is there with the shape the config implies; returns their dtype."""
    wanted = {name: shape for p in plans for name, shape in zip(p.hf, p.hf_shapes)}
    ignorable = {"lm_head.weight"} if spec.tie_word_embeddings else set()
    unexpected = sorted(n for n in reader.names() if n not in wanted and n not in ignorable
                        and not n.endswith("rotary_emb.inv_freq"))
    if unexpected:
        raise ValueError(f"tensor {unexpected[0]!r} is not part of a {spec.family} model with this config "
                         f"({len(unexpected)} unexpected tensors): checkpoint and config.json disagree")
    dtypes = set()
    for name, shape in wanted.items():
        if name not in reader:
            raise ValueError(f"tensor {name!r} is missing from {reader.dir} (config.json expects it)")
        got = reader.shape(name)
        dtypes.add(reader.dtype_name(name))
        if got != tuple(shape):
            raise ValueError(f"tensor {name!r} has shape {list(got)} but config.json implies {list(shape)}: "
                             f"checkpoint and config disagree")
    if len(dtypes) != 1:
        raise ValueError(f"mixed tensor dtypes in {reader.dir}: {sorted(dtypes)}")
    st_dtype = dtypes.pop()
    table = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    if st_dtype not in table:
        raise ValueError(f"tensor dtype {st_dtype} is not supported (F32, BF16, F16)")
    return table[st_dtype]


def _swiglu_halves(p: keymap.TensorPlan, template) -> list | None:
    """The two leaves of a SwiGLU ``linear_fc1`` factory when they are exactly the HF gate and up
    tensors (megatron-core stores the halves separately); None for anything else."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    if p.transform != "gate_up" or not isinstance(template, ShardedTensorFactory):
        return None
    leaves = template.build()
    if len(leaves) == 2 and all(tuple(leaf.local_shape) == tuple(s) for leaf, s in zip(leaves, p.hf_shapes)):
        return leaves
    return None


def _tensor_producers(sharded: dict, plans: list[keymap.TensorPlan], reader: HFReader, spec: ModelSpec) -> dict:
    """``{(sharded key, global offset): fn}`` making each stored chunk from the HF tensors when it is
    written. The templates stay meta tensors; a SwiGLU ``linear_fc1`` (a factory of two halves,
    which megatron-core concatenates) gets the HF gate and up tensors as its two halves."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    def check(p, shape):
        def produce():
            reader.release()  # the tensors produced before are written: drop their pages
            tensor = keymap.to_megatron(p, [reader.get(n) for n in p.hf], spec)
            if tuple(tensor.shape) != tuple(shape):
                raise AssertionError(f"{p.megatron}: converted shape {list(tensor.shape)}, expected {list(shape)}")
            return tensor
        return produce

    def half(p, i, shape):
        def produce():
            reader.release()
            tensor = reader.get(p.hf[i])
            if tuple(tensor.shape) != tuple(shape):
                raise AssertionError(f"{p.hf[i]}: shape {list(tensor.shape)}, expected {list(shape)}")
            return tensor
        return produce

    producers = {}
    for p in plans:
        template = sharded[MODEL_PREFIX + p.megatron]
        # the checkpoint stores the HF dtype (the meta model may build e.g. norms in float32)
        template.data = torch.empty(template.data.shape, dtype=spec.torch_dtype, device="meta")
        if hasattr(template, "dtype"):
            template.dtype = spec.torch_dtype
        if isinstance(template, ShardedTensorFactory):
            leaves = _swiglu_halves(p, template)
            if leaves is None:
                raise AssertionError(f"{p.megatron}: unexpected sharded factory {template}")
            for i, leaf in enumerate(leaves):
                producers[(leaf.key, tuple(leaf.global_offset))] = half(p, i, leaf.local_shape)
        else:
            assert tuple(template.data.shape) == tuple(p.megatron_shape), (p.megatron, template.data.shape)
            producers[(template.key, tuple(template.global_offset))] = check(p, template.local_shape)
    return producers


def _counted(produce, bar):
    def counted():
        tensor = produce()
        bar.update(1)
        return tensor
    return counted


def hf_to_megatron(hf: str | Path, out: Path, *, tp: int = 1, pp: int = 1) -> Path:
    """Convert an HF directory (or ``smollm2``) into a dist checkpoint at ``out``; returns ``out``."""
    from megatron_tir.policy.checkpoint.dist_writer import save_sharded

    hf_dir = resolve_model(hf)
    spec, config = spec_from_hf_dir(hf_dir)
    spec.check_layout(tp, pp)
    reader = HFReader(hf_dir)
    plans = keymap.plan(spec)
    dtype = _check_hf_tensors(reader, spec, plans)
    spec = dataclasses.replace(spec, dtype=str(dtype).removeprefix("torch."))
    with atomic_output_dir(out) as tmp:
        t0 = time.perf_counter()
        sharded = _model_templates(spec)
        producers = _tensor_producers(sharded, plans, reader, spec)
        from tqdm import tqdm

        bar = tqdm(total=len(producers), desc="hf-to-megatron", unit="tensor", disable=None, leave=False)  # TTY only
        producers = {k: _counted(fn, bar) for k, fn in producers.items()}
        try:
            save_sharded(sharded, tmp, producers=producers, copy_sources=reader.copy_sources())
        finally:
            bar.close()
            reader.close()
        del sharded
        log.info("read + converted + saved %d tensors in %.2f s", len(plans), time.perf_counter() - t0)
        copy_hf_files(hf_dir, tmp / HF_FILES_DIR)
        write_meta(tmp, CheckpointMeta(model_spec=spec.to_dict(), hf_config=config, tp=tp, pp=pp,
                                       source=str(hf_dir)))
    log.info("wrote Megatron checkpoint %s (%s, tp=%d pp=%d)", out, spec.family, tp, pp)
    return Path(out)


def megatron_to_hf(ckpt: Path, out: Path, *, max_shard_bytes: int = 5 * 2**30) -> Path:
    """Convert a policy checkpoint (or a step or run dir's latest) into an HF directory at ``out``
    (``megatron_tir.policy.checkpoint.export``: by megatron-core's sharded keys, whichever layer
    spec wrote it)."""
    from megatron_tir.policy.checkpoint.export import export_hf

    stats = export_hf(ckpt, out, max_shard_bytes=max_shard_bytes)
    log.info("%d of %d tensors copied file to file, %d read and rearranged", stats.copied, stats.tensors,
             stats.tensors - stats.copied)
    log.info("wrote HF model %s from %s", out, ckpt)
    return Path(out)

"""A policy checkpoint -> an HF directory, read by megatron-core's own sharded keys, no model built.

Each tensor of the key map (``keymap.plan``) is stored in the torch_dist checkpoint under
the sharded key megatron-core gives it (``TensorPlan.stored``: the same for the local and
the Transformer Engine layer spec; layers stacked on a leading axis, a SwiGLU ``linear_fc1``
as its gate and up halves of one global tensor); each is read alone from the files
(``dist_reader``), straight to bytes where one stored chunk is exactly an HF tensor (a TP=1
checkpoint: copied file to file) and rearranged in memory otherwise, and written into a
streaming safetensors writer: memory holds about one tensor. Entries the map does not name
(TE's ``_extra_state``, optimizer state) are not read, so a checkpoint written by either
spec, at any TP/PP, exports the same. A tensor holding NaN or inf is refused by its HF name (the
manifest proves the bytes are the saved ones, not that they are finite). Needs no process group: ``model_sources`` uses it to
give engines an HF directory for a checkpoint, ``tir-ckpt megatron-to-hf`` is built on it.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_tir.policy import keymap
from megatron_tir.policy.checkpoint.dist_reader import RegionReader
from megatron_tir.policy.checkpoint.hf_io import StreamingSafetensorsWriter, TensorEntry
from megatron_tir.policy.checkpoint.layout import (HF_FILES_DIR, MODEL_PREFIX, CheckpointMeta, atomic_output_dir,
                                                   copy_hf_files, read_meta, resolve_checkpoint)
from megatron_tir.policy.spec import ModelSpec

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True, frozen=True)
class ExportStats:
    tensors: int  # key-map tensors exported
    copied: int  # of them copied file to file (the rest read and rearranged in memory)


def _boxes(p: keymap.TensorPlan, spec: ModelSpec) -> tuple[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """(stored key, [(offsets, sizes)]): the whole tensor, or a SwiGLU ``linear_fc1``'s two halves
    (how megatron-core stores it), each a box of the stored (stacked) global tensor."""
    key, lead = p.stored  # leading indices: (layer,), (layer, expert) or ()
    ones = (1,) * len(lead)
    zeros = (0,) * (len(p.megatron_shape) - 1)
    if p.transform == "gate_up":
        f = p.hf_shapes[0][0]
        rest = p.megatron_shape[1:]
        return MODEL_PREFIX + key, [((*lead, 0, *zeros), (*ones, f, *rest)), ((*lead, f, *zeros), (*ones, f, *rest))]
    return MODEL_PREFIX + key, [((*lead, 0, *zeros), (*ones, *p.megatron_shape))]


def _check_stored(reader: RegionReader, key: str, p: keymap.TensorPlan, spec: ModelSpec) -> None:
    size = tuple(reader.tensor_meta(key).size)
    want = (spec.num_layers, spec.num_experts)[:len(p.stored[1])] + tuple(p.megatron_shape)
    if size != want:
        raise ValueError(f"{key} has global shape {list(size)}, the model implies {list(want)}")


def read_hf_tensors(reader: RegionReader, p: keymap.TensorPlan, spec: ModelSpec) -> list[torch.Tensor]:
    """The HF tensors of one plan (in ``p.hf`` order), read from the checkpoint. A SwiGLU
    ``linear_fc1``'s halves are the gate and up tensors directly (no concat + split)."""
    key, boxes = _boxes(p, spec)
    _check_stored(reader, key, p, spec)
    parts = [reader.read(key, offsets, sizes, spec.torch_dtype) for offsets, sizes in boxes]
    if p.transform == "gate_up":
        return [t.reshape(s) for t, s in zip(parts, p.hf_shapes)]
    return keymap.to_hf(p, parts[0].reshape(p.megatron_shape), spec)


def hf_byte_spans(reader: RegionReader, p: keymap.TensorPlan, spec: ModelSpec) -> list[list[tuple[int, int, int]]] | None:
    """For each HF tensor of one plan, the ``(fd, offset, length)`` byte spans of the checkpoint
    files that are exactly its bytes, in order; None unless each box is one stored chunk held as a
    plain contiguous tensor of the model's dtype (then ``read_hf_tensors``)."""
    key, boxes = _boxes(p, spec)
    _check_stored(reader, key, p, spec)
    regions = []
    for offsets, sizes in boxes:
        reg = reader.raw_region(key, offsets, sizes, spec.torch_dtype)
        if reg is None:
            return None
        regions.append((reader.fileno(reg), reg.offset, reg.length))
    if p.transform == "gate_up":
        return [[r] for r in regions]
    fd, base, _ = regions[0]
    row_bytes = spec.torch_dtype.itemsize * math.prod(p.megatron_shape[1:])
    return [[(fd, base + first * row_bytes, rows * row_bytes) for first, rows in blocks]
            for blocks in keymap.hf_row_spans(p, spec)]


def _spans_finite(spans: list[tuple[int, int, int]], dtype: torch.dtype, chunk: int = 64 << 20) -> bool:
    """Whether the ``dtype`` values in the file byte spans ``(fd, offset, length)`` are all finite."""
    step = chunk - chunk % dtype.itemsize
    for fd, offset, length in spans:
        for start in range(0, length, step):
            buf = bytearray(os.pread(fd, min(step, length - start), offset + start))
            if buf and not bool(torch.isfinite(torch.frombuffer(buf, dtype=dtype)).all()):
                return False
    return True


class NonFiniteTensorError(ValueError):
    """A tensor of the checkpoint holds NaN or inf (one line naming it)."""


def _check_finite(ckpt: Path, name: str, finite: bool) -> None:
    if not finite:
        raise NonFiniteTensorError(f"checkpoint {ckpt}: {name} holds non-finite values (NaN or inf): not exported "
                         f"(resume the run from an earlier checkpoint)")


def export_hf_config(meta: CheckpointMeta, spec: ModelSpec) -> dict:
    config = dict(meta.hf_config)
    qc = config.get("quantization_config")
    if isinstance(qc, dict) and qc.get("quant_method") == "gguf":
        config.pop("quantization_config")  # the weights we write are plain tensors
    config["dtype"] = spec.dtype
    if "torch_dtype" in config:  # transformers 4 spelling
        config["torch_dtype"] = spec.dtype
    config["tie_word_embeddings"] = spec.tie_word_embeddings
    return config


def export_hf(ckpt: Path, out: Path, *, max_shard_bytes: int = 5 * 2**30) -> ExportStats:
    """Write the HF directory ``out`` (atomically) from the policy checkpoint ``ckpt`` (or a step or
    run directory: ``resolve_checkpoint``)."""
    ckpt = resolve_checkpoint(Path(ckpt))
    meta = read_meta(ckpt)
    spec = meta.spec
    plans = keymap.plan(spec)
    entries = [TensorEntry(name=n, shape=tuple(s), dtype=spec.torch_dtype)
               for p in plans for n, s in zip(p.hf, p.hf_shapes)]
    copied = 0
    with atomic_output_dir(out) as tmp:
        with RegionReader(ckpt) as reader, \
                StreamingSafetensorsWriter(tmp, entries, max_shard_bytes=max_shard_bytes) as writer:
            for p in plans:
                try:
                    spans = hf_byte_spans(reader, p, spec)
                    if spans is not None:  # file to file, no tensor in memory
                        for name, tensor_spans in zip(p.hf, spans):
                            _check_finite(ckpt, name, _spans_finite(tensor_spans, spec.torch_dtype))
                            writer.copy(name, tensor_spans)
                        copied += 1
                        continue
                    tensors = read_hf_tensors(reader, p, spec)
                except NonFiniteTensorError:
                    raise
                except ValueError as e:
                    raise ValueError(f"checkpoint {ckpt} does not match its metadata ({spec.family}, "
                                     f"hidden {spec.hidden_size}, {spec.num_layers} layers): {e}") from None
                for name, t in zip(p.hf, tensors):
                    _check_finite(ckpt, name, bool(torch.isfinite(t).all()))
                    writer.write(name, t)
        hf_files = ckpt / HF_FILES_DIR
        if hf_files.is_dir():
            copy_hf_files(hf_files, tmp)
        (tmp / "config.json").write_text(json.dumps(export_hf_config(meta, spec), indent=2, sort_keys=True))
    log.info("exported %s to HF %s (%d of %d tensors copied file to file)", ckpt, out, copied, len(plans))
    return ExportStats(tensors=len(plans), copied=copied)

"""Streaming HF safetensors I/O: read one tensor at a time, write one tensor at a time.

``HFReader`` opens the file that holds a tensor only for the time it takes to copy it
out (``safe_open``), so no file stays mapped. ``StreamingSafetensorsWriter`` writes the
standard safetensors format (8-byte little-endian header length, JSON header, raw
little-endian data) from a list of names/shapes/dtypes known in advance, then accepts
the tensors one by one in that order: memory never holds more than the tensor in hand.
Files larger than ``max_shard_bytes`` are split into ``model-0000k-of-0000n.safetensors``
with a ``model.safetensors.index.json``, as transformers writes them.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

log = logging.getLogger(__name__)

_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
INDEX_NAME = "model.safetensors.index.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")


class HFReader:
    """Tensor name -> file for an HF directory; ``get(name)`` reads that tensor alone."""

    def __init__(self, hf_dir: Path) -> None:
        self.dir = Path(hf_dir)
        self.files: dict[str, Path] = {}
        index = self.dir / INDEX_NAME
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            for name, fname in weight_map.items():
                self.files[name] = self.dir / fname
            missing = sorted({p for p in self.files.values() if not p.is_file()})
            if missing:
                raise ValueError(f"{index} lists {missing[0].name}, which is missing")
        else:
            shards = sorted(self.dir.glob("*.safetensors"))
            if not shards:
                raise ValueError(f"no *.safetensors weights in {self.dir}")
            for shard in shards:
                with safe_open(shard, framework="pt") as f:
                    for name in f.keys():
                        self.files[name] = shard

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def names(self) -> list[str]:
        return list(self.files)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.files:
            raise ValueError(f"tensor {name!r} is missing from {self.dir}")
        with safe_open(self.files[name], framework="pt") as f:
            return f.get_tensor(name)


@dataclass(kw_only=True, slots=True, frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


def _header_bytes(entries: list[TensorEntry]) -> bytes:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for e in entries:
        header[e.name] = {"dtype": _ST_DTYPES[e.dtype], "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


class StreamingSafetensorsWriter:
    """Write tensors in a fixed, pre-declared order into one or more safetensors files."""

    def __init__(self, out_dir: Path, entries: list[TensorEntry], *, max_shard_bytes: int = 5 * 2**30) -> None:
        if max_shard_bytes <= 0:
            raise ValueError("max_shard_bytes must be positive")
        self.out_dir = Path(out_dir)
        shards: list[list[TensorEntry]] = [[]]
        size = 0
        for e in entries:
            if shards[-1] and size + e.nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(e)
            size += e.nbytes
        n = len(shards)
        names = ["model.safetensors"] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
        self._queue = [(fname, shard) for fname, shard in zip(names, shards)]
        self._order = [(fname, e) for fname, shard in self._queue for e in shard]
        self._pos = 0
        self._file = None
        self._file_name: str | None = None
        if n > 1:
            weight_map = {e.name: fname for fname, e in self._order}
            total = sum(e.nbytes for e in entries)
            (self.out_dir / INDEX_NAME).write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())  # durable before the output dir is renamed into place
            self._file.close()
            self._file = None

    def _open(self, fname: str) -> None:
        self._close_file()
        shard = dict(self._queue)[fname]
        self._file = open(self.out_dir / fname, "wb")
        self._file.write(_header_bytes(shard))
        self._file_name = fname

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._pos >= len(self._order):
            raise AssertionError(f"unexpected extra tensor {name}")
        fname, entry = self._order[self._pos]
        assert name == entry.name, f"tensor order: expected {entry.name}, got {name}"
        assert tuple(tensor.shape) == entry.shape and tensor.dtype == entry.dtype, (name, tensor.shape, tensor.dtype)
        if fname != self._file_name:
            self._open(fname)
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        self._file.write(memoryview(data))
        self._pos += 1

    def close(self) -> None:
        self._close_file()

    def __enter__(self) -> "StreamingSafetensorsWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and self._file is not None:
            self._file.close()
            self._file = None
        self.close()
        if exc_type is None and self._pos != len(self._order):
            raise AssertionError(f"only {self._pos} of {len(self._order)} tensors were written")

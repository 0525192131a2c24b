"""Streaming HF safetensors I/O: read one tensor at a time, write one tensor at a time.

``HFReader`` parses each file's header once and hands out tensors viewing a copy-on-write
mapping of the file (no copy), and drops their pages on ``release()``. ``StreamingSafetensorsWriter`` writes the
standard safetensors format (8-byte little-endian header length, JSON header, raw
little-endian data) from a list of names/shapes/dtypes known in advance, then accepts
the tensors one by one in that order: memory never holds more than the tensor in hand.
Files larger than ``max_shard_bytes`` are split into ``model-0000k-of-0000n.safetensors``
with a ``model.safetensors.index.json``, as transformers writes them.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
INDEX_NAME = "model.safetensors.index.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")


_TORCH_DTYPES = {v: k for k, v in _ST_DTYPES.items()}
_MADV_DONTNEED = 4


class HFReader:
    """Tensor name -> file for an HF directory; ``get(name)`` is that tensor, read in place.

    Each safetensors file's header is parsed once (names, dtypes, shapes, byte ranges) and the
    file is mapped copy-on-write; ``get`` returns a tensor *viewing* the mapping (no copy: the
    bytes come from the page cache when used). ``release()`` drops the pages of the tensors
    handed out so far from this process's memory (they stay valid and are read again if
    used), so a caller streaming tensor by tensor holds about one tensor resident.
    """

    def __init__(self, hf_dir: Path) -> None:
        self.dir = Path(hf_dir)
        self.files: dict[str, Path] = {}
        self._entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}  # dtype, shape, begin, end
        self._maps: dict[Path, mmap.mmap | None] = {}
        self._fds: dict[Path, int] = {}
        self._resident: list[tuple[mmap.mmap, int, int]] = []
        index = self.dir / INDEX_NAME
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            missing = sorted({self.dir / f for f in weight_map.values() if not (self.dir / f).is_file()})
            if missing:
                raise ValueError(f"{index} lists {missing[0].name}, which is missing")
            shards = sorted({self.dir / f for f in weight_map.values()})
        else:
            shards = sorted(self.dir.glob("*.safetensors"))
            if not shards:
                raise ValueError(f"no *.safetensors weights in {self.dir}")
        for shard in shards:
            for name, entry in _read_header(shard).items():
                self.files[name] = shard
                self._entries[name] = entry

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def names(self) -> list[str]:
        return list(self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[1]

    def dtype_name(self, name: str) -> str:
        """The safetensors dtype (``F32``, ``BF16``, ...)."""
        return self._entry(name)[0]

    def _entry(self, name: str) -> tuple[str, tuple[int, ...], int, int]:
        if name not in self._entries:
            raise ValueError(f"tensor {name!r} is missing from {self.dir}")
        return self._entries[name]

    def get(self, name: str) -> torch.Tensor:
        st_dtype, shape, begin, end = self._entry(name)
        dtype = _TORCH_DTYPES.get(st_dtype)
        if dtype is None:
            raise ValueError(f"tensor {name!r}: dtype {st_dtype} is not supported")
        if end == begin:
            return torch.empty(shape, dtype=dtype)
        mm = self._map(self.files[name])
        self._resident.append((mm, begin, end))
        if begin % dtype.itemsize:  # misaligned for its dtype: a copy
            return torch.frombuffer(bytearray(mm[begin:end]), dtype=dtype).view(shape)
        return torch.frombuffer(mm, dtype=dtype, count=(end - begin) // dtype.itemsize, offset=begin).view(shape)

    def copy_sources(self) -> list[tuple[int, int, int]]:
        """``(address, length, fd)`` of every file mapped so far (and of all, mapping them now):
        writers may copy bytes that lie in a mapping from its file instead (the mappings are
        never written, so they hold exactly the file's bytes)."""
        return [(buffer_address(mm), len(mm), self._fds[path])
                for path in sorted(set(self.files.values())) if (mm := self._map(path)) is not None]

    def _map(self, path: Path) -> mmap.mmap | None:
        """The file's copy-on-write mapping (made on first use, its fd kept); None if it is empty."""
        if path not in self._maps:
            fd = self._fds[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            self._maps[path] = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY) if os.fstat(fd).st_size else None
        return self._maps[path]

    def close(self) -> None:
        """Close the files (tensors still viewing a mapping keep it alive)."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def release(self) -> None:
        """Drop the pages of every tensor handed out so far from this process's resident memory."""
        page = mmap.PAGESIZE
        for mm, begin, end in self._resident:
            start = begin - begin % page
            if end > start:
                mm.madvise(_MADV_DONTNEED, start, end - start)
        self._resident.clear()


def buffer_address(buf) -> int:
    """The address of a buffer's first byte (read-only buffers included)."""
    return np.frombuffer(buf, dtype=np.uint8).__array_interface__["data"][0]


def _read_header(path: Path) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
    """name -> (dtype, shape, absolute begin, absolute end) from a safetensors header, checked."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path} is not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, 100 << 20):
            raise ValueError(f"{path} is not a safetensors file (header length {n})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} has a corrupt safetensors header: {e}") from None
    out = {}
    base = 8 + n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: bad header entry for {name!r}") from None
        itemsize = _TORCH_DTYPES[dtype].itemsize if dtype in _TORCH_DTYPES else None
        if not 0 <= begin <= end or base + end > size or (
                itemsize is not None and end - begin != itemsize * math.prod(shape)):
            raise ValueError(f"{path}: tensor {name!r} has a bad byte range [{begin}, {end}) (file truncated?)")
        out[name] = (dtype, shape, base + begin, base + end)
    return out


_COPY_FILE_RANGE_FAILS = (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM)
_copy_file_range_works = True  # until a filesystem refuses it (e.g. tmpfs: EXDEV)
_copy_buffer: bytearray | None = None  # reused: fresh pages for every copy cost more than the copy


def copy_range(src_fd: int, offset: int, length: int, dst_fd: int) -> None:
    """Append ``length`` bytes at ``offset`` of ``src_fd`` to ``dst_fd`` (at its position):
    ``copy_file_range`` (in the kernel, no user-space buffer), or pread + write through one
    reused buffer where the filesystems do not support it."""
    global _copy_file_range_works, _copy_buffer
    done = 0
    if _copy_file_range_works:
        try:
            while done < length:
                n = os.copy_file_range(src_fd, dst_fd, length - done, offset + done)
                if n == 0:
                    raise OSError(errno.EIO, f"unexpected end of file at {offset + done}")
                done += n
            return
        except OSError as e:
            if e.errno not in _COPY_FILE_RANGE_FAILS:
                raise
            _copy_file_range_works = False
    if _copy_buffer is None:
        _copy_buffer = bytearray(8 << 20)
    buf = memoryview(_copy_buffer)
    while done < length:
        got = os.preadv(src_fd, [buf[: min(length - done, len(buf))]], offset + done)
        if got == 0:
            raise OSError(errno.EIO, f"unexpected end of file at {offset + done}")
        view = buf[:got]
        while view:
            view = view[os.write(dst_fd, view):]
        done += got


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

    def _next(self, name: str) -> TensorEntry:
        if self._pos >= len(self._order):
            raise AssertionError(f"unexpected extra tensor {name}")
        fname, entry = self._order[self._pos]
        assert name == entry.name, f"tensor order: expected {entry.name}, got {name}"
        if fname != self._file_name:
            self._open(fname)
        return entry

    def write(self, name: str, tensor: torch.Tensor) -> None:
        entry = self._next(name)
        assert tuple(tensor.shape) == entry.shape and tensor.dtype == entry.dtype, (name, tensor.shape, tensor.dtype)
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        self._file.write(memoryview(data))
        self._pos += 1

    def copy(self, name: str, spans: list[tuple[int, int, int]]) -> None:
        """Write tensor ``name`` from byte spans ``(fd, offset, length)`` of other files, in order
        (already in this tensor's dtype and layout): copied file to file by the kernel."""
        entry = self._next(name)
        if sum(n for _, _, n in spans) != entry.nbytes:
            raise AssertionError(f"{name}: {sum(n for _, _, n in spans)} bytes given, {entry.nbytes} expected")
        self._file.flush()
        out = self._file.fileno()
        for fd, offset, length in spans:
            copy_range(fd, offset, length, out)
        self._pos += 1

    def close(self) -> None:
        self._close_file()

    def __enter__(self) -> StreamingSafetensorsWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and self._file is not None:
            self._file.close()
            self._file = None
        self.close()
        if exc_type is None and self._pos != len(self._order):
            raise AssertionError(f"only {self._pos} of {len(self._order)} tensors were written")

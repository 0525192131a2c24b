"""Read one region of one tensor from a torch_dist checkpoint, in a single process.

megatron-core's ``dist_checkpointing.load`` can load a partial state dict, but with one
process it cannot describe a slice of a stacked tensor (it needs another rank to own the
rest). Export reads layer by layer, so it reads the DCP files directly: PyTorch's
``FileSystemReader`` gives the metadata, ``create_read_items_for_chunk_list`` the stored
chunks that overlap the requested box (whatever TP/PP wrote them), and each chunk (one
``torch.save`` record inside a ``.distcp`` file) is ``torch.load``-ed from its byte range
of a file kept open, as PyTorch's reader does, without re-planning or re-opening per read.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import math
import pickle
import struct
import zipfile
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list


def _narrow(t: torch.Tensor, offsets, lengths) -> torch.Tensor:
    for dim, (o, n) in enumerate(zip(offsets, lengths)):
        if o != 0 or n != t.shape[dim]:
            t = t.narrow(dim, o, n)
    return t


class _FileSlice(io.RawIOBase):
    """Read-only, seekable view of ``length`` bytes at ``offset`` of an open file (what torch.load needs)."""

    def __init__(self, f, offset: int, length: int) -> None:
        super().__init__()
        self.f, self.start, self.end, self.pos = f, offset, offset + length, offset

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos - self.start

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: self.start, io.SEEK_CUR: self.pos, io.SEEK_END: self.end}[whence]
        self.pos = min(max(base + pos, self.start), self.end)
        return self.pos - self.start

    def readinto(self, buf) -> int:
        n = min(len(buf), self.end - self.pos)
        if n <= 0:
            return 0
        self.f.seek(self.pos)
        got = self.f.readinto(memoryview(buf)[:n])
        self.pos += got
        return got


def _member_span(f, base: int, length: int, member: zipfile.ZipInfo) -> tuple[int, int]:
    """(absolute offset, size) of a stored (uncompressed) zip member inside ``f[base:base+length]``."""
    if member.compress_type != zipfile.ZIP_STORED or member.compress_size != member.file_size:
        raise ValueError(f"zip member {member.filename} is compressed")
    f.seek(base + member.header_offset)
    local = f.read(30)
    if len(local) != 30 or local[:4] != b"PK\x03\x04":
        raise ValueError("bad zip local header")
    name_len, extra_len = struct.unpack("<HH", local[26:30])
    start = base + member.header_offset + 30 + name_len + extra_len
    if start + member.file_size > base + length:
        raise ValueError("zip member runs past its record")
    return start, member.file_size


# torch.save's legacy storage class names (what its pickle names) -> dtype
_STORAGE_DTYPES = {
    "FloatStorage": torch.float32, "BFloat16Storage": torch.bfloat16, "HalfStorage": torch.float16,
    "DoubleStorage": torch.float64, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
}


@dataclasses.dataclass(frozen=True, slots=True)
class RawRegion:
    """Where the bytes of one stored tensor chunk lie: ``length`` bytes at ``offset`` of ``path``,
    C-contiguous, in ``dtype`` and ``shape`` (torch.save keeps storages uncompressed)."""

    path: Path
    offset: int
    length: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class _TensorRecord:
    storage_key: str
    dtype: torch.dtype
    storage_numel: int
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild_tensor_meta(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None,
                         metadata=None):
    _, dtype, key, numel = storage
    return _TensorRecord(storage_key=key, dtype=dtype, storage_numel=numel, storage_offset=storage_offset,
                         size=tuple(size), stride=tuple(stride))


class _TensorMetaUnpickler(pickle.Unpickler):
    """Reads what a torch.save of one tensor says about it (storage, offset, size, stride)
    without loading its data; anything else in the pickle is refused."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor_meta
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        raise pickle.UnpicklingError(f"not a plain tensor record: {module}.{name}")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        _, dtype, key, _location, numel = pid
        return ("storage", dtype, key, numel)


def _contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(size):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


class RegionReader:
    """``read(key, offsets, sizes)`` -> that box of the global tensor ``key``.

    Files stay open between reads (``close()`` / context manager); each stored chunk that
    overlaps the box is loaded straight from its place in the file, and when one chunk is
    exactly the box (the usual case: one layer of a stacked tensor written at TP=1) the
    loaded tensor is returned as is, without a second copy.
    """

    def __init__(self, ckpt_dir: Path) -> None:
        self.dir = str(ckpt_dir)
        self._fs_reader = FileSystemReader(self.dir)
        self.metadata = self._fs_reader.read_metadata()
        self.storage = self.metadata.storage_data
        self._files: dict[str, object] = {}

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> RegionReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _file(self, relative_path: str):
        f = self._files.get(relative_path)
        if f is None:
            f = self._files[relative_path] = open(Path(self.dir) / relative_path, "rb", buffering=0)
        return f

    def fileno(self, region: RawRegion) -> int:
        """An open descriptor of the file ``region`` lies in (kept open with the reader)."""
        return self._file(str(region.path.relative_to(self.dir))).fileno()

    def tensor_meta(self, key: str) -> TensorStorageMetadata:
        md = self.metadata.state_dict_metadata.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise ValueError(f"tensor {key!r} is not in checkpoint {self.dir}")
        return md

    def _load_item(self, item: ReadItem) -> torch.Tensor:
        info = self.storage[item.storage_index]
        if getattr(info, "transform_descriptors", None):
            raise ValueError(f"checkpoint {self.dir}: stream transforms {info.transform_descriptors} "
                             f"are not supported")
        stored = torch.load(_FileSlice(self._file(info.relative_path), info.offset, info.length),
                            map_location="cpu", weights_only=True)
        return _narrow(stored, item.storage_offsets, item.lengths)

    def raw_region(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...],
                   dtype: torch.dtype) -> RawRegion | None:
        """Where the bytes of exactly this box lie in the checkpoint's files, if one stored chunk
        is the box and holds it as a plain C-contiguous tensor of ``dtype`` (so it can be copied
        file to file); None otherwise (another layout, a view, a cast): use ``read``."""
        md = self.tensor_meta(key)
        if len(offsets) != len(md.size):
            return None
        items = create_read_items_for_chunk_list(
            key, md, [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))])
        if len(items) != 1 or tuple(items[0].lengths) != tuple(sizes) or any(items[0].storage_offsets):
            return None
        info = self.storage[items[0].storage_index]
        if getattr(info, "transform_descriptors", None):
            return None
        f = self._file(info.relative_path)
        try:  # (members are read at their offsets: the writer may leave the CRCs out)
            with zipfile.ZipFile(_FileSlice(f, info.offset, info.length)) as z:
                pkl = next(i for i in z.infolist() if i.filename.endswith("/data.pkl"))
                start, size = _member_span(f, info.offset, info.length, pkl)
                f.seek(start)
                record = _TensorMetaUnpickler(io.BytesIO(f.read(size))).load()
                if not isinstance(record, _TensorRecord):
                    return None
                data = z.getinfo(pkl.filename.removesuffix("data.pkl") + f"data/{record.storage_key}")
                start, size = _member_span(f, info.offset, info.length, data)
        except (zipfile.BadZipFile, pickle.UnpicklingError, StopIteration, KeyError, ValueError, EOFError):
            return None
        if (record.dtype != dtype or record.storage_offset != 0 or record.size != tuple(sizes)
                or record.stride != _contiguous_strides(record.size)
                or record.storage_numel != math.prod(record.size)
                or size != record.storage_numel * dtype.itemsize):
            return None
        return RawRegion(path=Path(self.dir) / info.relative_path, offset=start, length=size,
                         dtype=dtype, shape=tuple(sizes))

    def read(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...],
             dtype: torch.dtype | None = None) -> torch.Tensor:
        md = self.tensor_meta(key)
        if len(offsets) != len(md.size) or any(o + s > g for o, s, g in zip(offsets, sizes, md.size)):
            raise ValueError(f"tensor {key!r} has global shape {list(md.size)}; "
                             f"cannot read offsets {list(offsets)} sizes {list(sizes)}")
        dtype = dtype or md.properties.dtype
        items = create_read_items_for_chunk_list(
            key, md, [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))])
        covered = sum(int(torch.Size(i.lengths).numel()) for i in items)
        if covered != torch.Size(sizes).numel():
            raise ValueError(f"checkpoint {self.dir} does not hold all of {key!r} at {list(offsets)}")
        if len(items) == 1 and tuple(items[0].lengths) == tuple(sizes):
            t = self._load_item(items[0])
            if tuple(t.shape) != tuple(sizes):
                raise ValueError(f"checkpoint {self.dir}: chunk of {key!r} has shape {list(t.shape)}, "
                                 f"expected {list(sizes)}")
            if t.dtype == dtype and t.is_contiguous() and t.untyped_storage().nbytes() == t.nbytes:
                return t
            return t.to(dtype, copy=True).contiguous()
        dest = torch.empty(sizes, dtype=dtype)
        for item in sorted(items, key=lambda i: (self.storage[i.storage_index].relative_path,
                                                 self.storage[i.storage_index].offset)):
            part = self._load_item(item)
            target = _narrow(dest, item.dest_offsets, item.lengths)
            if target.shape != part.shape:
                raise ValueError(f"checkpoint {self.dir}: chunk of {key!r} has shape {list(part.shape)}, "
                                 f"expected {list(target.shape)}")
            target.copy_(part)
        return dest

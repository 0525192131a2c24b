"""Save a megatron-core torch_dist checkpoint synchronously, in this process.

``dist_checkpointing.save`` with its default strategy (``TorchDistSaveShardedStrategy``)
runs its async machinery even for a synchronous save: on the first save in a process it
starts a ``multiprocessing`` manager with the "spawn" method (a fresh interpreter) for a
result queue, then forks one writer process per bucket, and it clones every tensor that
is a view before writing (the SwiGLU halves, stacked layers). For a one-shot conversion
that costs seconds and memory and buys nothing.

``InProcessTorchDistSaveStrategy`` is a ``TorchDistSaveShardedStrategy`` (same backend
name and version, so ``metadata.json`` says ``torch_dist`` v1 and megatron-core's
``dist_checkpointing.load`` treats it as its own) whose ``save`` translates the sharded
state dict with megatron-core's own functions and planner (``mcore_to_pyt_state_dict``,
``MCoreSavePlanner``) and hands it to PyTorch's ``torch.distributed.checkpoint.save``
with a plain ``FileSystemWriter``: one ``__<rank>_0.distcp`` file per rank written by
this thread, views copied one at a time while writing, each file fsynced
(``sync_files=True``), ``.metadata`` written by the coordinator. ``common.pt`` and
``metadata.json`` are still written by ``dist_checkpointing.save`` itself, so the
directory is exactly what megatron-core expects.

By default torch.save's zip CRC32 is not computed for the records while saving
(``torch.serialization.set_crc32_options``, restored afterwards): ``torch.load`` (and so
megatron-core's loader) does not verify it, and computing it costs a pass over every byte.
``crc32=True`` keeps it.

With ``producers`` the state dict's tensors can be meta tensors: each chunk is made by its
producer when the writer reaches it (what ``hf_to_megatron`` does to hold ~one tensor).
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from pathlib import Path


import torch
from megatron.core.dist_checkpointing.strategies.torch import (MCoreSavePlanner, TorchDistSaveShardedStrategy,
                                                               _replace_state_dict_keys_with_sharded_keys,
                                                               mcore_to_pyt_state_dict)
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.planner import WriteItemType

from megatron_tir.policy.checkpoint import manifest
from megatron_tir.policy.checkpoint.hf_io import buffer_address, copy_range

log = logging.getLogger(__name__)


class _CopyingStream(io.RawIOBase):
    """The file a ``FileSystemWriter`` writes, where a write of bytes that lie in a mapped source
    file (a tensor viewing an ``HFReader`` mapping, handed to ``torch.save``) is done by the
    kernel from that file (``copy_file_range``) instead of from memory: the same bytes, without
    faulting the source's pages into this process. Other writes are buffered."""

    _MIN_COPY = 1 << 16

    def __init__(self, path, mode: str, sources: list[tuple[int, int, int]]) -> None:
        super().__init__()
        self._file = open(path, mode, buffering=0)
        self._sources = sources  # (address, length, fd) of each mapped source file
        self._buf = bytearray()
        self._pos = 0
        self.copied = 0  # bytes copied from a source file by the kernel

    def writable(self) -> bool:
        return True

    def _source(self, view: memoryview) -> tuple[int, int] | None:
        addr = buffer_address(view)
        for base, length, fd in self._sources:
            if base <= addr and addr + view.nbytes <= base + length:
                return fd, addr - base
        return None

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        n = view.nbytes
        src = self._source(view) if n >= self._MIN_COPY and self._sources else None
        if src is not None:
            self.flush()
            copy_range(src[0], src[1], n, self._file.fileno())
            self.copied += n
        else:
            self._buf += view
            if len(self._buf) >= 1 << 20:
                self.flush()
        self._pos += n
        return n

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        if self._file.closed:
            return
        data = memoryview(bytes(self._buf))  # (a view of the bytearray itself would pin its size)
        self._buf.clear()
        while data:
            data = data[self._file.write(data):]

    def fileno(self) -> int:
        self.flush()  # (called for fsync)
        return self._file.fileno()

    def close(self) -> None:
        if not self.closed:
            try:
                self.flush()
            finally:
                self._file.close()
                super().close()


class _WritingFileSystem(FileSystem):
    """Streams opened for reading or update are torch's own; write streams come from ``_writer``."""

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode or "+" in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with self._writer(path, mode) as stream:
            yield stream

    def _writer(self, path, mode: str):
        raise NotImplementedError


class _CopyingFileSystem(_WritingFileSystem):
    def __init__(self, sources: list[tuple[int, int, int]]) -> None:
        super().__init__()
        self.sources = sources

    @contextlib.contextmanager
    def _writer(self, path, mode: str):
        with _CopyingStream(path, mode, self.sources) as stream:
            yield stream
        if stream.copied:
            log.info("%s: %d of %d bytes copied file to file", Path(path).name, stream.copied, stream.tell())


class _HashingFileSystem(_WritingFileSystem):
    """Files written through it are hashed on the way (``manifest.recording``: a run checkpoint's manifest)."""

    def _writer(self, path, mode: str):
        return manifest.hashing_stream(path, mode)


class InProcessTorchDistSaveStrategy(TorchDistSaveShardedStrategy):
    """torch_dist v1, written by the calling thread (no manager process, no forked writers)."""

    def __init__(self, *, crc32: bool = False, producers: dict | None = None,
                 copy_sources: list[tuple[int, int, int]] | None = None) -> None:
        super().__init__("torch_dist", 1, keep_only_main_replica=True, thread_count=1)
        self.crc32 = crc32
        self.producers = producers
        self.copy_sources = copy_sources

    def save(self, sharded_state_dict, checkpoint_dir: str | Path) -> None:
        flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
        pyt_state_dict = mcore_to_pyt_state_dict(flat, False)
        writer = FileSystemWriter(str(checkpoint_dir), single_file_per_rank=True, sync_files=True, thread_count=1)
        if self.copy_sources:
            writer.fs = _CopyingFileSystem(self.copy_sources)
        elif manifest.is_recording():
            writer.fs = _HashingFileSystem()
        planner_cls = _ProducingSavePlanner if self.producers is not None else MCoreSavePlanner
        planner = planner_cls(dedup_replicated_tensors=not self.keep_only_main_replica, flatten_state_dict=False)
        if self.producers is not None:
            planner.producers = self.producers
        previous = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(self.crc32)
        try:
            # one rank: no collectives (they would pickle the whole save plan through tensors)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp_save(pyt_state_dict, storage_writer=writer, planner=planner,
                         no_dist=torch.distributed.get_world_size() == 1)
        finally:
            torch.serialization.set_crc32_options(previous)

    def async_save(self, sharded_state_dict, checkpoint_dir):  # pragma: no cover - not used
        raise NotImplementedError("InProcessTorchDistSaveStrategy saves synchronously; use save()")


class _ProducingSavePlanner(MCoreSavePlanner):
    """Asks ``producers[(sharded key, global offset)]()`` for each tensor chunk at the moment it
    is written, so the state dict can hold meta tensors (shapes and dtypes only) and memory
    holds one chunk at a time instead of the whole model."""

    producers: dict

    def resolve_data(self, write_item):
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        key = (write_item.index.fqn, tuple(write_item.index.offset))
        produce = self.producers.get(key)
        if produce is None:
            return super().resolve_data(write_item)
        tensor = produce()
        chunk = write_item.tensor_data.chunk
        props = write_item.tensor_data.properties
        if tuple(tensor.shape) != tuple(chunk.sizes):  # e.g. the leading 1 of a stacked layer
            tensor = tensor.reshape(tuple(chunk.sizes))
        if tensor.dtype != props.dtype:
            raise AssertionError(f"{key}: produced {tensor.dtype}, checkpoint metadata says {props.dtype}")
        return tensor.detach().contiguous()


def save_sharded(sharded_state_dict, checkpoint_dir: str | Path, *, crc32: bool = False,
                 producers: dict | None = None, copy_sources: list[tuple[int, int, int]] | None = None) -> None:
    """``dist_checkpointing.save`` (common.pt, metadata.json, validation) with the in-process writer.

    ``producers``: optional ``{(sharded key, global offset tuple): fn() -> tensor}``; tensors
    of the state dict with a producer may be meta tensors (their data is made when written).
    ``copy_sources``: ``(address, length, fd)`` of read-only file mappings (``HFReader``):
    tensor bytes that lie in one are copied from its file by the kernel (see ``_CopyingStream``).
    """
    from megatron.core import dist_checkpointing

    if not torch.distributed.is_initialized():
        raise RuntimeError("save_sharded needs an initialized torch.distributed process group")
    strategy = InProcessTorchDistSaveStrategy(crc32=crc32, producers=producers, copy_sources=copy_sources)
    dist_checkpointing.save(sharded_state_dict, str(checkpoint_dir), sharded_strategy=strategy)

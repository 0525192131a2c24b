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

import warnings
from pathlib import Path

import torch
from megatron.core.dist_checkpointing.strategies.torch import (MCoreSavePlanner, TorchDistSaveShardedStrategy,
                                                               _replace_state_dict_keys_with_sharded_keys,
                                                               mcore_to_pyt_state_dict)
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.planner import WriteItemType


class InProcessTorchDistSaveStrategy(TorchDistSaveShardedStrategy):
    """torch_dist v1, written by the calling thread (no manager process, no forked writers)."""

    def __init__(self, *, crc32: bool = False, producers: dict | None = None) -> None:
        super().__init__("torch_dist", 1, keep_only_main_replica=True, thread_count=1)
        self.crc32 = crc32
        self.producers = producers

    def save(self, sharded_state_dict, checkpoint_dir: str | Path) -> None:
        flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
        pyt_state_dict = mcore_to_pyt_state_dict(flat, False)
        writer = FileSystemWriter(str(checkpoint_dir), single_file_per_rank=True, sync_files=True, thread_count=1)
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
                 producers: dict | None = None) -> None:
    """``dist_checkpointing.save`` (common.pt, metadata.json, validation) with the in-process writer.

    ``producers``: optional ``{(sharded key, global offset tuple): fn() -> tensor}``; tensors
    of the state dict with a producer may be meta tensors (their data is made when written).
    """
    from megatron.core import dist_checkpointing

    if not torch.distributed.is_initialized():
        raise RuntimeError("save_sharded needs an initialized torch.distributed process group")
    strategy = InProcessTorchDistSaveStrategy(crc32=crc32, producers=producers)
    dist_checkpointing.save(sharded_state_dict, str(checkpoint_dir), sharded_strategy=strategy)

"""Read one region of one tensor from a torch_dist checkpoint, in a single process.

megatron-core's ``dist_checkpointing.load`` can load a partial state dict, but with one
process it cannot describe a slice of a stacked tensor (it needs another rank to own the
rest). Export reads layer by layer, so it uses PyTorch's own DCP reader directly:
``FileSystemReader`` + read items computed by ``create_read_items_for_chunk_list`` for
the requested box; whatever TP/PP wrote the chunks, the overlapping parts are copied.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list


def _narrow(t: torch.Tensor, offsets, lengths) -> torch.Tensor:
    for dim, (o, n) in enumerate(zip(offsets, lengths)):
        if o != 0 or n != t.shape[dim]:
            t = t.narrow(dim, o, n)
    return t


class _IntoTensor(LoadPlanner):
    """The minimal planner a StorageReader needs: copy read chunks into one destination tensor."""

    def __init__(self, dest: torch.Tensor) -> None:
        self.dest = dest

    def set_up_planner(self, *args, **kwargs):  # pragma: no cover - not used by read_data
        pass

    def create_local_plan(self):  # pragma: no cover
        raise NotImplementedError

    def create_global_plan(self, global_plan):  # pragma: no cover
        raise NotImplementedError

    def finish_plan(self, central_plan):  # pragma: no cover
        return central_plan

    def load_bytes(self, read_item, value):  # pragma: no cover - tensors only
        raise AssertionError(f"unexpected non-tensor item {read_item}")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return _narrow(self.dest, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


class RegionReader:
    """``read(key, offsets, sizes)`` -> that box of the global tensor ``key``."""

    def __init__(self, ckpt_dir: Path) -> None:
        self.dir = str(ckpt_dir)
        self.metadata = FileSystemReader(self.dir).read_metadata()

    def tensor_meta(self, key: str) -> TensorStorageMetadata:
        md = self.metadata.state_dict_metadata.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise ValueError(f"tensor {key!r} is not in checkpoint {self.dir}")
        return md

    def read(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...],
             dtype: torch.dtype | None = None) -> torch.Tensor:
        md = self.tensor_meta(key)
        if len(offsets) != len(md.size) or any(o + s > g for o, s, g in zip(offsets, sizes, md.size)):
            raise ValueError(f"tensor {key!r} has global shape {list(md.size)}; "
                             f"cannot read offsets {list(offsets)} sizes {list(sizes)}")
        dest = torch.empty(sizes, dtype=dtype or md.properties.dtype)
        items = create_read_items_for_chunk_list(
            key, md, [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))])
        covered = sum(int(torch.Size(i.lengths).numel()) for i in items)
        if covered != dest.numel():
            raise ValueError(f"checkpoint {self.dir} does not hold all of {key!r} at {list(offsets)}")
        reader = FileSystemReader(self.dir)
        reader.set_up_storage_reader(self.metadata, True)
        plan = reader.prepare_local_plan(LoadPlan(items))
        reader.read_data(plan, _IntoTensor(dest)).wait()
        return dest

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
"""

from __future__ import annotations

from pathlib import Path

import torch
from megatron.core.dist_checkpointing.strategies.torch import (MCoreSavePlanner, TorchDistSaveShardedStrategy,
                                                               _replace_state_dict_keys_with_sharded_keys,
                                                               mcore_to_pyt_state_dict)
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint import save as dcp_save


class InProcessTorchDistSaveStrategy(TorchDistSaveShardedStrategy):
    """torch_dist v1, written by the calling thread (no manager process, no forked writers)."""

    def __init__(self) -> None:
        super().__init__("torch_dist", 1, keep_only_main_replica=True, thread_count=1)

    def save(self, sharded_state_dict, checkpoint_dir: str | Path) -> None:
        flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
        pyt_state_dict = mcore_to_pyt_state_dict(flat, False)
        writer = FileSystemWriter(str(checkpoint_dir), single_file_per_rank=True, sync_files=True, thread_count=1)
        planner = MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica,
                                   flatten_state_dict=False)
        dcp_save(pyt_state_dict, storage_writer=writer, planner=planner)

    def async_save(self, sharded_state_dict, checkpoint_dir):  # pragma: no cover - not used
        raise NotImplementedError("InProcessTorchDistSaveStrategy saves synchronously; use save()")


def save_sharded(sharded_state_dict, checkpoint_dir: str | Path) -> None:
    """``dist_checkpointing.save`` (common.pt, metadata.json, validation) with the in-process writer."""
    from megatron.core import dist_checkpointing

    if not torch.distributed.is_initialized():
        raise RuntimeError("save_sharded needs an initialized torch.distributed process group")
    dist_checkpointing.save(sharded_state_dict, str(checkpoint_dir), sharded_strategy=InProcessTorchDistSaveStrategy())

"""What a weight sync may read from the trainer's model: a :class:`WeightSource`.

Every engine's weight sync is ``update(source)`` on every trainer rank
(:class:`megatron_tir.rollout.sync.base.WeightSync`); the source is the policy's side of that
seam, and these four members are all a sync may touch. The
:class:`~megatron_tir.policy.learner.Learner` is one (its ``named_hf_buckets`` /
``stage_buckets`` are collective: every rank of the model exhausts them at the same time).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

Bucket = tuple[int, list[tuple[str, "torch.Tensor"]]]  # (pipeline stage, [(HF name, full tensor), ...])
Layout = list[list[list[tuple[str, tuple[int, ...]]]]]  # stage -> bucket -> (HF name, shape)


@runtime_checkable
class WeightSource(Protocol):
    """The trainer's current weights as HF-named buckets."""

    def named_hf_buckets(self, bucket_bytes: int = ...) -> Iterator[Bucket]:
        """Every stage's buckets on global rank 0 (relayed there); the other ranks get nothing but
        must exhaust the iterator (it is collective)."""
        ...

    def stage_buckets(self, bucket_bytes: int = ...) -> Iterator[Bucket]:
        """This rank's stage's buckets on the stage's sender (nothing passes through rank 0);
        collective over the stage's TP group."""
        ...

    def bucket_layout(self, bucket_bytes: int = ...) -> Layout:
        """Per stage, the ``[(HF name, shape), ...]`` of each bucket ``stage_buckets`` yields
        there (from the model's spec: no tensor is built)."""
        ...

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype of every tensor in the buckets."""
        ...

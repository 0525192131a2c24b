"""Weight sync per engine kind: the trainer's weights into the generation engine.

``base`` (:class:`WeightSync`, the every-rank contract ``update(source)``; :class:`EngineWeightSync`,
a rank-0 engine's transport of buckets, and :class:`Rank0WeightSync`, which puts one on every rank),
``local`` (the in-process LocalEngine), ``sglang`` (SGLang servers through rank 0: a broadcast
group, or CUDA IPC when colocated), ``stages`` (SGLang servers from every pipeline stage's sender).
:data:`megatron_tir.rollout.factory.ENGINE_KINDS` picks the ones for an engine kind.
"""

from megatron_tir.rollout.sync.base import Bucket, EngineWeightSync, Rank0WeightSync, WeightSync, buckets_of, drain

__all__ = ["Bucket", "EngineWeightSync", "Rank0WeightSync", "WeightSync", "buckets_of", "drain"]

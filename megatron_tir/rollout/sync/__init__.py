"""Weight sync per engine kind: the learner's HF-named buckets into the generation engine.

``base`` (the :class:`WeightSync` protocol, buckets), ``local`` (the in-process
LocalEngine), ``sglang`` (SGLang servers: a broadcast group, or CUDA IPC when colocated).
:func:`megatron_tir.rollout.factory.build_weight_sync` picks the one for an engine.
"""

from megatron_tir.rollout.sync.base import Bucket, WeightSync, buckets_of, drain

__all__ = ["Bucket", "WeightSync", "buckets_of", "drain"]

"""Generation engines: token ids in; sampled ids, their log-probs and the finish reason out.

``LocalEngine`` (torch, in process; the CPU default) and ``SGLangEngine`` (HTTP client
for SGLang servers on GPUs) implement :class:`GenerationEngine`.
"""

from megatron_tir.rollout.engines.base import FinishReason, Generation, GenerationEngine, SamplingParams

__all__ = ["FinishReason", "Generation", "GenerationEngine", "SamplingParams"]

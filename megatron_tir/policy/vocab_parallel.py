"""Per-token log-probs and entropy from tensor-parallel (vocab-sharded) logits.

Each TP rank holds ``logits_SBV`` for its slice of the vocabulary; full-vocabulary logits
are never gathered. ``token_logprobs`` is megatron-core's ``vocab_parallel_cross_entropy``
(negated) on ``logits / temperature``; ``token_entropy`` reduces ``max``, ``sum exp`` and
``sum exp * z`` over the TP group (``reduce_from_tensor_model_parallel_region``: all-reduce
forward, identity backward, the gradient of a sum). Both are differentiable.
"""

from __future__ import annotations

import torch


def token_logprobs(logits_SBV: torch.Tensor, target_SB: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log softmax(logits / temperature)[target]`` as ``[S, B]`` float32.

    megatron-core's cross-entropy works in place on its input: at temperature 1 on float32
    logits that input is ``logits_SBV`` itself (as in megatron-core's own language-model loss;
    the output layer's backward does not need its output), so compute anything else from the
    logits first."""
    from megatron.core import tensor_parallel

    scaled_SBV = logits_SBV.float() if temperature == 1.0 else logits_SBV.float() / temperature
    return -tensor_parallel.vocab_parallel_cross_entropy(scaled_SBV, target_SB)


def token_entropy(logits_SBV: torch.Tensor, temperature: float) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` over the whole vocabulary, ``[S, B]`` float32."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    z_SBV = logits_SBV.float() / temperature
    max_SB = z_SBV.max(dim=-1).values.detach()
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(max_SB, op=torch.distributed.ReduceOp.MAX,
                                     group=parallel_state.get_tensor_model_parallel_group())
    shifted_SBV = z_SBV - max_SB.unsqueeze(-1)
    exp_SBV = shifted_SBV.exp()
    sum_exp_SB = reduce_from_tensor_model_parallel_region(exp_SBV.sum(dim=-1))
    sum_exp_z_SB = reduce_from_tensor_model_parallel_region((exp_SBV * shifted_SBV).sum(dim=-1))
    return sum_exp_SB.log() - sum_exp_z_SB / sum_exp_SB

"""Core attention for megatron-core's local layer spec through ``torch``'s fused SDPA.

megatron-core's ``DotProductAttention`` (the local spec, i.e. without Transformer Engine)
materialises the ``[b, heads, s, s]`` scores and probabilities and keeps them for
backward; on CPU that is most of a train step's memory at a few thousand tokens per
micro-batch. ``SdpaDotProductAttention`` computes the same causal softmax attention
(scale ``1/sqrt(head_dim)``, grouped-query heads) with
``torch.nn.functional.scaled_dot_product_attention``, which keeps no score matrix. Any
case it does not cover (another mask type, an explicit mask or bias, packed sequences,
attention dropout while training) runs megatron-core's own implementation.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class SdpaDotProductAttention(DotProductAttention):
    """``DotProductAttention`` with the causal case computed by fused SDPA (see the module docstring)."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        dropout = self.attention_dropout.p if self.training else 0.0
        if (mask_type != AttnMaskType.causal or attention_mask is not None or attention_bias is not None
                or packed_seq_params is not None or dropout > 0 or self.softmax_offset is not None):
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        sq, b = query.shape[0], query.shape[1]
        # [s, b, heads, d] -> [b, heads, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        context = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=q.shape[1] != k.shape[1])
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

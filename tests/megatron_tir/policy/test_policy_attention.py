"""The SDPA core attention equals megatron-core's DotProductAttention (values and gradients)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_config

from megatron_tir.policy.spec import ModelSpec


@pytest.mark.parametrize("heads,groups", [(4, 2), (4, 4)], ids=["gqa", "mha"])
def test_sdpa_attention_equals_megatron_core(parallel_1x1, heads, groups):
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_tir.policy.attention import SdpaDotProductAttention

    config = ModelSpec.from_hf(tiny_config("qwen2", num_heads=heads, num_kv_heads=groups)).transformer_config()
    attn = SdpaDotProductAttention(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                   attention_type="self")
    g = torch.Generator().manual_seed(0)
    s, b, d = 7, 3, config.kv_channels
    q = torch.randn(s, b, heads, d, generator=g, requires_grad=True)
    k = torch.randn(s, b, groups, d, generator=g, requires_grad=True)
    v = torch.randn(s, b, groups, d, generator=g, requires_grad=True)
    grad = torch.randn(s, b, heads * d, generator=g)
    outs = []
    for forward in (attn.forward, super(SdpaDotProductAttention, attn).forward):
        out = forward(q, k, v, None)
        (qg, kg, vg) = torch.autograd.grad(out, (q, k, v), grad)
        outs.append((out.detach(), qg, kg, vg))
    for ours, theirs in zip(*outs):
        assert ours.shape == theirs.shape
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)

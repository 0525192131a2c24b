"""FP8 with sequence parallelism: every planned micro-batch shape passes Transformer Engine's FP8 dimension check.

The rule, read from Transformer Engine's source (transformer_engine/pytorch/utils.py, ``assert_dim_for_fp8_exec``,
called with the input of ``Linear`` / ``LayerNormLinear`` / ``LayerNormMLP`` when FP8 is on): the product of an input's
leading dims must be divisible by 8. A micro-batch of ``rows`` rows padded to ``L`` tokens enters the layers as
``[L, rows, h]``; under sequence parallelism a column-parallel layer checks its local shard ``[L / tp, rows, h]``
before the all-gather, a row-parallel one the gathered ``[L, rows, h / tp]``. The check is written out here from
that reading, not taken from the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_tir.policy.learner_config import LearnerConfig
from megatron_tir.policy.microbatch import plan_microbatches


def te_fp8_inputs_ok(rows: int, length: int, tp: int, sequence_parallel: bool) -> bool:
    """Transformer Engine's FP8 check on every GEMM input shape a ``[rows, length]`` micro-batch produces."""
    if sequence_parallel and length % tp:
        return False  # megatron-core splits the sequence evenly over the TP ranks
    shard = length // tp if sequence_parallel else length
    leading = (shard * rows, length * rows)  # column-parallel input (local shard), row-parallel input (gathered)
    return all(n % 8 == 0 for n in leading)


def _masks(seed: int, count: int = 40, rows: int = 9, width: int = 700) -> list[torch.Tensor]:
    """Random batches: 1..rows rows of random lengths, left or right padded (as the trainer's batches are)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        n = int(torch.randint(1, rows + 1, (1,), generator=g))
        attn = torch.zeros(n, width, dtype=torch.bool)
        for b in range(n):
            length = int(torch.randint(1, width + 1, (1,), generator=g))
            start = int(torch.randint(0, width - length + 1, (1,), generator=g))
            attn[b, start:start + length] = True
        out.append(attn)
    return out


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("max_tokens", [512, 4096])
def test_every_planned_micro_batch_passes_te_fp8_check_under_sequence_parallelism(tp, max_tokens):
    cfg = LearnerConfig(tp=tp, sequence_parallel=True, fp8="e4m3", max_tokens_per_microbatch=max_tokens)
    assert cfg.pad_multiple == math.lcm(8 * tp, 16)
    shapes = set()
    for attn in _masks(seed=tp * 1000 + max_tokens):
        for dp_size in (1, 2):
            for dp_rank in range(dp_size):
                for mb in plan_microbatches(attn, max_tokens=max_tokens, dp_rank=dp_rank, dp_size=dp_size,
                                            pad_to=cfg.pad_multiple):
                    shapes.add((len(mb.rows), mb.length))
    assert any(rows == 1 for rows, _ in shapes) and any(rows > 1 for rows, _ in shapes)
    bad = [(rows, length) for rows, length in sorted(shapes) if not te_fp8_inputs_ok(rows, length, tp, True)]
    assert not bad, f"TP {tp}: micro-batch shapes (rows, L) Transformer Engine refuses under FP8 + SP: {bad[:5]}"


@pytest.mark.parametrize("tp", [4, 8])
def test_padding_to_lcm_tp_16_is_not_enough_for_te(tp):
    """The old rule (lcm(TP, 16)) plans a one-row micro-batch whose local shard TE refuses."""
    attn = torch.zeros(1, 40, dtype=torch.bool)
    attn[0, :10] = True
    (mb,) = plan_microbatches(attn, max_tokens=4096, pad_to=math.lcm(tp, 16))
    assert (len(mb.rows), mb.length) == (1, 16)
    assert not te_fp8_inputs_ok(1, mb.length, tp, True)
    (mb,) = plan_microbatches(attn, max_tokens=4096, pad_to=LearnerConfig(
        tp=tp, sequence_parallel=True, fp8="hybrid").pad_multiple)
    assert mb.length == 8 * tp and te_fp8_inputs_ok(1, mb.length, tp, True)


@pytest.mark.parametrize("tp, sp, fp8, expected", [
    (2, False, "e4m3", 16),   # FP8 alone: 16
    (4, True, None, 4),       # sequence parallelism alone: TP
    (2, True, "e4m3", 16),    # lcm(8 x 2, 16)
    (4, True, "e4m3", 32),
    (8, True, "e4m3", 64),
])
def test_pad_multiple_per_layout(tp, sp, fp8, expected):
    cfg = LearnerConfig(tp=tp, sequence_parallel=sp, fp8=fp8)
    assert cfg.pad_multiple == expected
    if fp8:
        assert all(te_fp8_inputs_ok(rows, expected * k, tp, sp) for rows in (1, 3) for k in (1, 2))

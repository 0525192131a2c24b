"""The planner's loss-path bytes per logit element against a measured forward + backward on CPU.

Measured with torch's profiler (``profile_memory=True``): every allocation and free from just before the
logits exist (a leaf of the activation dtype standing for the output layer's output) through
``TokenLoss`` (the real policy loss, ``rl.loss.PolicyLoss``, on vocab-parallel log-probs at TP 1) and
``backward()`` until the logits' gradient is there, replayed in time order; the peak of live bytes over the
start, divided by the logits' elements, is compared with ``plan_memory.logits_bytes_per_elem`` (plus one
chunk of the entropy diagnostic's temporaries, which the planner counts apart). The chunk is set to 1/32
of the micro-batch here, about its share at the recipes' shapes (2^24 of 32768 x 38016 elements is 1/74).
"""

from __future__ import annotations

import gc

import pytest
import torch

from megatron_tir.launch.plan_memory import ENTROPY_DIAGNOSTIC_BYTES_PER_CHUNK_ELEM, logits_bytes_per_elem

MARK_BYTES = 7_654_321
B, L, V = 2, 1024, 8192  # 16.8M logit elements: 32 MiB in bf16


@pytest.fixture(scope="module")
def parallel_1x1():
    from megatron_tir.policy.parallel import destroy_parallel, init_parallel

    init_parallel(1, 1)
    yield
    destroy_parallel()


def _peak_over_start(prof) -> float:
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live, start, peak = 0, None, 0
    for e in events:
        if start is None and e.nbytes() == MARK_BYTES:
            start = peak = live
        live += e.nbytes()
        if start is not None:
            peak = max(peak, live)
    assert start is not None, "the mark allocation was not seen"
    return float(peak - start)


def measured_bytes_per_elem(dtype: torch.dtype, entropy: str, temperature: float) -> float:
    from megatron_tir.policy.learner_contract import LossInputs
    from megatron_tir.policy.losses import TokenLoss
    from megatron_tir.rl.loss import LossConfig, PolicyLoss

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, V, (B, L), generator=g)
    mask = torch.ones(B, L, dtype=torch.bool)
    extras = {"old_logprobs_BT": -torch.rand(B, L, generator=g) * 10, "advantages_BT": torch.randn(B, L, generator=g)}
    source = torch.randn(B, L, V, generator=g).to(dtype)
    loss_fn = TokenLoss(token_loss=PolicyLoss(LossConfig(entropy_coef=1e-3 if entropy == "grad" else 0.0)),
                        temperature=temperature, with_entropy=entropy != "none")
    gc.collect()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        mark = torch.empty(MARK_BYTES, dtype=torch.uint8)  # its allocation event marks the start
        del mark
        logits = source.clone().requires_grad_(True)  # the output layer's output
        loss_bL, _ = loss_fn(logits, LossInputs(tokens_bL=tokens, mask_bL=mask, extras=extras))
        (loss_bL * mask).sum().backward()
        assert logits.grad is not None
        del logits, loss_bL
    return _peak_over_start(prof) / (B * L * V)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("entropy", ["none", "diagnostic", "grad"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_loss_path_bytes_per_logit_element_within_20_percent_of_measured(parallel_1x1, monkeypatch, dtype, entropy,
                                                                         temperature):
    import megatron_tir.policy.losses as losses

    chunk = B * L * V // 32
    monkeypatch.setattr(losses, "ENTROPY_CHUNK_ELEMS", chunk)
    measured = measured_bytes_per_elem(dtype, entropy, temperature)
    a = 2 if dtype == torch.bfloat16 else 4
    planned = logits_bytes_per_elem(a, temperature=temperature, entropy_grad=entropy == "grad")
    if entropy == "diagnostic":
        planned += chunk * ENTROPY_DIAGNOSTIC_BYTES_PER_CHUNK_ELEM / (B * L * V)
    print(f"{dtype} entropy={entropy} T={temperature}: planner {planned:.2f} B/elem, measured {measured:.2f}")
    assert 0.8 <= planned / measured <= 1.2


def test_the_entropy_diagnostic_costs_nothing_in_the_backward_graph(parallel_1x1, monkeypatch):
    """bf16 at T = 1: with the diagnostic the loss path holds what it holds without entropy (8 B per element);
    with autograd (the trainer's old diagnostic, kept when the token loss does not say) it held ~18."""
    import megatron_tir.policy.losses as losses

    monkeypatch.setattr(losses, "ENTROPY_CHUNK_ELEMS", B * L * V // 32)
    none = measured_bytes_per_elem(torch.bfloat16, "none", 1.0)
    diagnostic = measured_bytes_per_elem(torch.bfloat16, "diagnostic", 1.0)
    assert none == pytest.approx(8.0, abs=0.5) and diagnostic == pytest.approx(none, abs=1.0)

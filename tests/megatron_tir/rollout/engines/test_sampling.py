"""sample_tokens against a brute-force reference of the truncated, temperature-scaled softmax."""

from __future__ import annotations

import math

import pytest
import torch
from megatron_tir.rollout.engines.sampling import sample_tokens


def reference_distribution(logits, temperature, top_p, top_k):
    """Plain-Python nucleus/top-k: keep the k most likely, then the smallest prefix with mass >= top_p."""
    probs = torch.softmax(torch.tensor(logits, dtype=torch.float64) / temperature, dim=-1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, mass = [], 0.0
    for rank, i in enumerate(order):
        if (top_k > 0 and rank >= top_k) or (kept and mass >= top_p):
            break
        kept.append(i)
        mass += probs[i]
    total = sum(probs[i] for i in kept)
    return [probs[i] / total if i in kept else 0.0 for i in range(len(probs))]


def draw(logits, n, temperature, top_p, top_k, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits_BV = torch.tensor([logits] * n, dtype=torch.float32)
    return sample_tokens(
        logits_BV,
        temperature_B=torch.full((n,), temperature),
        top_p_B=torch.full((n,), top_p),
        top_k_B=torch.full((n,), top_k, dtype=torch.long),
        uniform_BV=torch.rand(logits_BV.shape, generator=g),
    )


LOGITS = [2.0, 1.5, 1.0, 0.3, -0.5, -2.0]


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, -1), (0.6, 1.0, -1), (1.3, 0.8, -1),
                                                     (1.0, 1.0, 3), (0.9, 0.7, 4), (1.0, 0.01, -1)])
def test_empirical_frequencies_match_the_truncated_softmax(temperature, top_p, top_k):
    n = 40_000
    tokens, logprobs = draw(LOGITS, n, temperature, top_p, top_k)
    expected = reference_distribution(LOGITS, temperature, top_p, top_k)
    counts = torch.bincount(tokens, minlength=len(LOGITS)).double() / n
    for p_hat, p in zip(counts.tolist(), expected):
        assert abs(p_hat - p) <= 4 * math.sqrt(p * (1 - p) / n) + 1e-12, (counts.tolist(), expected)
    # The log-prob is under the temperature-scaled softmax, before truncation.
    full = torch.log_softmax(torch.tensor(LOGITS) / temperature, dim=-1)
    torch.testing.assert_close(logprobs, full[tokens])


def test_greedy_is_argmax_with_logprob_at_temperature_one():
    tokens, logprobs = draw(LOGITS[::-1], 5, 0.0, 1.0, -1)
    assert tokens.tolist() == [5] * 5
    torch.testing.assert_close(logprobs, torch.log_softmax(torch.tensor(LOGITS[::-1]), -1)[5].expand(5))


def test_top_k_one_is_argmax_whatever_the_noise():
    tokens, _ = draw(LOGITS, 1000, 2.0, 1.0, 1)
    assert set(tokens.tolist()) == {0}


def test_a_row_does_not_depend_on_its_batch_neighbours():
    torch.manual_seed(0)
    logits_BV = torch.randn(4, 1000) * 3
    uniform_BV = torch.rand(4, 1000)
    params = dict(temperature_B=torch.tensor([1.0, 0.0, 0.7, 1.2]), top_p_B=torch.tensor([1.0, 1.0, 0.9, 0.5]),
                  top_k_B=torch.tensor([-1, -1, 20, -1]))
    together, together_lp = sample_tokens(logits_BV, uniform_BV=uniform_BV, **params)
    for row in range(4):
        alone, alone_lp = sample_tokens(logits_BV[row : row + 1], uniform_BV=uniform_BV[row : row + 1],
                                        **{k: v[row : row + 1] for k, v in params.items()})
        assert alone.item() == together[row].item()
        assert alone_lp.item() == together_lp[row].item()


@pytest.mark.parametrize("ties", [False, True])
def test_partial_sort_truncation_equals_the_full_sort(monkeypatch, ties):
    """The candidate (top-k partial sort) path keeps exactly what a full stable sort keeps,
    including rows whose nucleus is wider than the candidates and ties at their boundary."""
    from megatron_tir.rollout.engines import sampling

    g = torch.Generator().manual_seed(3)
    rows, vocab = 24, 3000
    logits = torch.randn(rows, vocab, generator=g) * torch.linspace(0.2, 8.0, rows)[:, None]
    if ties:
        logits = (logits * 2).round() / 2  # many equal values, some straddling the candidates' boundary
    logp = torch.log_softmax(logits, dim=-1)
    top_p = torch.linspace(0.05, 1.0, rows)
    top_k = torch.tensor([-1, 5, 300, 3000] * (rows // 4))
    monkeypatch.setattr(sampling, "TRUNCATION_CANDIDATES", 10**9)  # the full sort for every row
    reference = sampling._truncation_mask(logp, top_p, top_k)
    monkeypatch.setattr(sampling, "TRUNCATION_CANDIDATES", 64)
    got = sampling._truncation_mask(logp, top_p, top_k)
    assert torch.equal(got, reference)
    kept = reference.sum(dim=-1)
    assert (kept > 64).any() and (kept < 64).any()  # both paths were taken

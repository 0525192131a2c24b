"""Next-token sampling as a pure tensor function (temperature, top-k, top-p, greedy).

Which log-prob is returned (the trainer's log pi_old):
    ``log_softmax(logits / T)[token]`` -- the log-probability of the sampled token under
    the temperature-scaled distribution, taken *before* top-k / top-p truncation and
    renormalization. This is the distribution the trainer can recompute from the same
    logits (``log_softmax(logits / T)``) without knowing the truncation, and it equals
    the sampling distribution exactly when ``top_p == 1`` and ``top_k == -1`` (the RL
    defaults). With ``T == 0`` (greedy) the token is the arg-max and its log-prob is
    taken at ``T = 1``.

Determinism: each row draws exactly one uniform number per step from its own
``torch.Generator`` (the caller passes it in ``uniform_B``), and the token is found by
inverse-CDF over the vocabulary sorted by probability (stable sort, so ties go to the
lower token id). A row's token therefore depends only on its own logits and its own
random stream, not on which other requests share the batch.
"""

from __future__ import annotations

import torch


def sample_tokens(
    logits_BV: torch.Tensor,
    *,
    temperature_B: torch.Tensor,
    top_p_B: torch.Tensor,
    top_k_B: torch.Tensor,
    uniform_B: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; returns ``(token_ids_B int64, logprobs_B float32)``.

    ``temperature_B`` float (0 = greedy), ``top_p_B`` float in (0, 1], ``top_k_B`` int64
    (-1 = off), ``uniform_B`` float in [0, 1) -- all on ``logits_BV.device``.
    """
    assert logits_BV.ndim == 2, logits_BV.shape
    batch, vocab = logits_BV.shape
    logits = logits_BV.float()
    greedy_B = temperature_B <= 0
    temp_B = torch.where(greedy_B, torch.ones_like(temperature_B), temperature_B).float()
    logp_BV = torch.log_softmax(logits / temp_B[:, None], dim=-1)

    # Truncate in probability order; the first (most likely) token is always kept.
    sorted_logp_BV, order_BV = torch.sort(logp_BV, dim=-1, descending=True, stable=True)
    sorted_p_BV = sorted_logp_BV.exp()
    rank_V = torch.arange(vocab, device=logits.device)
    k_B = torch.where(top_k_B < 0, torch.full_like(top_k_B, vocab), top_k_B)
    keep_BV = rank_V[None, :] < k_B[:, None]
    mass_before_BV = sorted_p_BV.cumsum(dim=-1) - sorted_p_BV
    keep_BV &= mass_before_BV < top_p_B[:, None].float()
    keep_BV[:, 0] = True

    cdf_BV = (sorted_p_BV * keep_BV).cumsum(dim=-1)
    target_B = uniform_B.float() * cdf_BV[:, -1]
    # First sorted position whose cumulative mass exceeds the target (skips zero-mass entries).
    pos_B = torch.searchsorted(cdf_BV, target_B[:, None], right=True).squeeze(1).clamp_(max=vocab - 1)
    sampled_B = order_BV.gather(1, pos_B[:, None]).squeeze(1)
    token_B = torch.where(greedy_B, order_BV[:, 0], sampled_B)
    logprob_B = logp_BV.gather(1, token_B[:, None]).squeeze(1)
    return token_B, logprob_B

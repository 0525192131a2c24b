"""Next-token sampling as a pure tensor function (temperature, top-k, top-p, greedy).

Which log-prob is returned (the trainer's log pi_old):
    ``log_softmax(logits / T)[token]`` -- the log-probability of the sampled token under
    the temperature-scaled distribution, taken *before* top-k / top-p truncation and
    renormalization. This is the distribution the trainer can recompute from the same
    logits (``log_softmax(logits / T)``) without knowing the truncation, and it equals
    the sampling distribution exactly when ``top_p == 1`` and ``top_k == -1`` (the RL
    defaults). With ``T == 0`` (greedy) the token is the arg-max and its log-prob is
    taken at ``T = 1``.

Determinism: sampling is Gumbel-max -- ``argmax(logits / T + g)`` over the kept tokens,
with ``g = -log(-log(u))`` and one uniform ``u`` per vocabulary entry drawn from the
request's own ``torch.Generator`` (the caller passes them in ``uniform_BV``). This draws
exactly from the truncated, renormalized softmax, and a row's token depends only on its
own logits and its own random stream, not on which other requests share the batch. It
is also robust to float noise: batched and unbatched matmuls differ in the last bits
(~1e-6), and Gumbel-max changes its choice only when the top two perturbed scores lie
that close (probability ~1e-6 per token), whereas inverse-CDF sampling over a flat
49k-token distribution flips a token every few dozen steps.
"""

from __future__ import annotations

import torch


def sample_tokens(
    logits_BV: torch.Tensor,
    *,
    temperature_B: torch.Tensor,
    top_p_B: torch.Tensor,
    top_k_B: torch.Tensor,
    uniform_BV: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; returns ``(token_ids_B int64, logprobs_B float32)``.

    ``temperature_B`` float (0 = greedy), ``top_p_B`` float in (0, 1], ``top_k_B`` int64
    (-1 = off), ``uniform_BV`` float in [0, 1) with the logits' shape -- all on
    ``logits_BV.device``.
    """
    assert logits_BV.ndim == 2 and uniform_BV.shape == logits_BV.shape, (logits_BV.shape, uniform_BV.shape)
    greedy_B = temperature_B <= 0
    temp_B = torch.where(greedy_B, torch.ones_like(temperature_B), temperature_B).float()
    logp_BV = torch.log_softmax(logits_BV.float() / temp_B[:, None], dim=-1)

    keep_BV = torch.ones_like(logp_BV, dtype=torch.bool)
    if bool(((top_k_B > 0) | (top_p_B < 1)).any()):
        keep_BV = _truncation_mask(logp_BV, top_p_B, top_k_B)

    gumbel_BV = -torch.log(-torch.log(uniform_BV.float()))
    score_BV = torch.where(keep_BV, logp_BV + gumbel_BV, torch.full_like(logp_BV, -torch.inf))
    token_B = torch.where(greedy_B, logp_BV.argmax(dim=-1), score_BV.argmax(dim=-1))
    logprob_B = logp_BV.gather(1, token_B[:, None]).squeeze(1)
    return token_B, logprob_B


TRUNCATION_CANDIDATES = 256  # top-k / top-p are decided among this many best tokens when that suffices


def _kept_in_order(sorted_logp_BK: torch.Tensor, top_p_B: torch.Tensor, k_B: torch.Tensor) -> torch.Tensor:
    """Which of the tokens, in descending stable probability order, top-k and top-p keep (a prefix)."""
    sorted_p_BK = sorted_logp_BK.exp()
    rank_K = torch.arange(sorted_logp_BK.shape[1], device=sorted_logp_BK.device)
    keep_BK = rank_K[None, :] < k_B[:, None]
    keep_BK &= (sorted_p_BK.cumsum(dim=-1) - sorted_p_BK) < top_p_B[:, None].float()
    keep_BK[:, 0] = True  # the most likely token is always kept
    return keep_BK


def _truncation_mask(logp_BV: torch.Tensor, top_p_B: torch.Tensor, top_k_B: torch.Tensor) -> torch.Tensor:
    """The top-k / top-p keep mask over the vocabulary, in probability order with ties by token id.

    Decided among the best ``TRUNCATION_CANDIDATES`` tokens of each row (a partial sort);
    a row whose kept set might reach past them, or past a tie at their boundary, is
    decided over its full sorted vocabulary instead -- the same mask either way.
    """
    vocab = logp_BV.shape[1]
    k_B = torch.where(top_k_B > 0, top_k_B, torch.full_like(top_k_B, vocab))
    keep_BV = torch.zeros_like(logp_BV, dtype=torch.bool)
    full_B = torch.ones(logp_BV.shape[0], dtype=torch.bool, device=logp_BV.device)
    if vocab > TRUNCATION_CANDIDATES:
        values_BK, index_BK = torch.topk(logp_BV, TRUNCATION_CANDIDATES, dim=-1)
        index_BK, by_index = index_BK.sort(dim=-1)  # ties by token id, as a stable sort of the row
        values_BK, by_value = values_BK.gather(1, by_index).sort(dim=-1, descending=True, stable=True)
        index_BK = index_BK.gather(1, by_value)
        keep_BK = _kept_in_order(values_BK, top_p_B, k_B)
        kept_B = keep_BK.sum(dim=-1)
        # Ranks holding values above the smallest candidate are the row's true first ranks.
        exact_B = (values_BK > values_BK[:, -1:]).sum(dim=-1)
        full_B = (kept_B >= TRUNCATION_CANDIDATES) | (kept_B > exact_B)
        keep_BV.scatter_(1, index_BK, keep_BK & ~full_B[:, None])
    if bool(full_B.any()):
        rows = full_B.nonzero().squeeze(1)
        sorted_logp, order = torch.sort(logp_BV[rows], dim=-1, descending=True, stable=True)
        keep_sorted = _kept_in_order(sorted_logp, top_p_B[rows], k_B[rows])
        keep_BV[rows] = torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)
    return keep_BV

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
    vocab = logits_BV.shape[1]
    greedy_B = temperature_B <= 0
    temp_B = torch.where(greedy_B, torch.ones_like(temperature_B), temperature_B).float()
    logp_BV = torch.log_softmax(logits_BV.float() / temp_B[:, None], dim=-1)

    keep_BV = torch.ones_like(logp_BV, dtype=torch.bool)
    if bool(((top_k_B > 0) | (top_p_B < 1)).any()):
        # Truncate in probability order; the most likely token is always kept.
        sorted_logp_BV, order_BV = torch.sort(logp_BV, dim=-1, descending=True, stable=True)
        sorted_p_BV = sorted_logp_BV.exp()
        rank_V = torch.arange(vocab, device=logp_BV.device)
        k_B = torch.where(top_k_B > 0, top_k_B, torch.full_like(top_k_B, vocab))
        keep_sorted_BV = rank_V[None, :] < k_B[:, None]
        keep_sorted_BV &= (sorted_p_BV.cumsum(dim=-1) - sorted_p_BV) < top_p_B[:, None].float()
        keep_sorted_BV[:, 0] = True
        keep_BV = torch.zeros_like(keep_BV).scatter_(1, order_BV, keep_sorted_BV)

    gumbel_BV = -torch.log(-torch.log(uniform_BV.float()))
    score_BV = torch.where(keep_BV, logp_BV + gumbel_BV, torch.full_like(logp_BV, -torch.inf))
    token_B = torch.where(greedy_B, logp_BV.argmax(dim=-1), score_BV.argmax(dim=-1))
    logprob_B = logp_BV.gather(1, token_B[:, None]).squeeze(1)
    return token_B, logprob_B

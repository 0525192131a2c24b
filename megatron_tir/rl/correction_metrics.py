"""The rollout correction's metrics (:mod:`megatron_tir.rl.correction`), as sums and counts.

Each mean is ``(sum, count)`` over this replica's rows and each maximum a float, so that
:func:`megatron_tir.train.row_stats.reduce_over_replicas` adds them up over the data-parallel
replicas into the batch's. Over the loss tokens (rows: those with a loss token) before rejection,
with ``d`` the clamped log-ratio ``learner - engine``, ``rho = exp(d)`` and ``S`` a row's clamped
``sum d``; the off-policy diagnostics are verl's ``compute_offpolicy_metrics``
(``verl/trainer/ppo/rollout_corr_helper.py``):

* ``k3_kl``: mean of ``rho - d - 1`` (verl ``k3_kl``), in float64 with ``expm1``;
* ``chi2_token``: ``E_token[rho^2] - 1`` (verl ``chi2_token``), ``chi2_seq``: ``E_row[exp(S)^2] - 1``
  (verl ``chi2_seq``; ``S`` clamped to +-20 as verl's ``log_ratio_sum_safe``), in float64 as ``expm1(2 d)``;
* ``learner_ppl`` / ``engine_ppl``: per row ``exp(-mean_t logprob)``, averaged over the rows (verl
  ``training_ppl`` / ``rollout_ppl``); ``log_ppl_diff``: per row ``mean engine - mean learner`` (the log
  of the row's learner / engine perplexity ratio; positive: the learner finds the tokens less likely),
  averaged over the rows (verl ``log_ppl_diff``); from the unclamped log-probs;
* ``veto_share``: rows vetoed by ``token_veto`` (verl ``rollout_is_veto_fraction``; 0 without a veto);
* ``log_ratio_mean`` / ``log_ratio_abs_mean`` / ``log_ratio_abs_max``, ``weight_mean`` (applied weight,
  kept tokens), ``weight_max`` (untruncated, the mode's level), ``clipped_share``, ``rejected_share``
  (vetoed tokens included) and per turn ``K``: ``k3_kl_turn_K``, ``log_ratio_abs_mean_turn_K``.

verl averages its perplexities and ``chi2_seq`` over every row of the batch; here over the rows
with a loss token (a row without one has no perplexity).
"""

from __future__ import annotations

import torch

SAFETY_BOUND = 20.0  # |log-ratio| bound before exp (verl rollout_corr_helper.py SAFETY_BOUND)


def add_metrics(means: dict[str, tuple[float, float]], maxima: dict[str, float], *, old_logprobs_BT: torch.Tensor,
                engine_logprobs_BT: torch.Tensor, d_BT: torch.Tensor, on_BT: torch.Tensor, rho_BT: torch.Tensor,
                weights_BT: torch.Tensor | None, clipped_BT: torch.Tensor, rejected_BT: torch.Tensor,
                vetoed_B: torch.Tensor, turn_index_BT: torch.Tensor | None = None) -> None:
    """The metrics into ``means`` / ``maxima``. ``d_BT``: the clamped log-ratio (0 off the loss tokens
    ``on_BT``); ``rho_BT``: the untruncated weight of the mode's level; ``weights_BT``: the applied ones
    (None: every weight 1); ``vetoed_B``: the rows the veto took out."""
    def mean(name: str, values: torch.Tensor) -> None:
        means[name] = (float(values.double().sum()), float(values.numel()))

    d = d_BT[on_BT]
    d64_BT = d_BT.double()
    k3_BT = torch.expm1(d64_BT) - d64_BT  # rho - d - 1, exact to ~d^2/2 (float32 rounds a 1e-6 gap to 0 or below)
    mean("log_ratio_mean", d)
    mean("log_ratio_abs_mean", d.abs())
    mean("k3_kl", k3_BT[on_BT])
    mean("chi2_token", torch.expm1(2 * d64_BT)[on_BT])  # rho^2 - 1
    mean("clipped_share", clipped_BT[on_BT].float())
    mean("rejected_share", rejected_BT[on_BT].float())
    kept_BT = on_BT & ~rejected_BT
    w_BT = torch.ones_like(d_BT) if weights_BT is None else weights_BT
    mean("weight_mean", w_BT[kept_BT])
    maxima["log_ratio_abs_max"] = float(d.abs().max())
    maxima["weight_max"] = float(rho_BT[on_BT].max())

    rows_B = on_BT.any(1)
    on64_BT = on_BT.double()
    n_B = on64_BT.sum(1).clamp_min(1)
    s_B = d64_BT.sum(1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    mean("chi2_seq", torch.expm1(2 * s_B)[rows_B])  # exp(S)^2 - 1
    learner_B = torch.where(on_BT, old_logprobs_BT.detach().double(), 0.0).sum(1) / n_B  # mean log-prob of the row
    engine_B = torch.where(on_BT, engine_logprobs_BT.detach().double(), 0.0).sum(1) / n_B
    mean("learner_ppl", torch.exp(-learner_B[rows_B]))
    mean("engine_ppl", torch.exp(-engine_B[rows_B]))
    mean("log_ppl_diff", (engine_B - learner_B)[rows_B])
    mean("veto_share", vetoed_B[rows_B].float())

    if turn_index_BT is not None:
        turns_BT = torch.where(on_BT, turn_index_BT, torch.full_like(turn_index_BT, -1))
        for k in sorted(int(k) for k in turns_BT.unique() if k >= 0):
            in_k = turns_BT == k
            mean(f"k3_kl_turn_{k}", k3_BT[in_k])
            mean(f"log_ratio_abs_mean_turn_{k}", d_BT[in_k].abs())

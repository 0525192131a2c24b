"""Rollout correction: the gap between the policy that sampled (the engine) and the learner's.

The engine's log-probs of the tokens it sampled (``engine``) come from other kernels, maybe
another precision (FP8 rollout) and, in asynchronous training, older weights; the learner's
recompute at the start of the step (``old``) is the policy the PPO ratio is clipped against (in
the asynchronous modes the proximal policy of the decoupled objective: AReaL
``areal/utils/functional.py: ppo_actor_loss_fn``). The correction reweights or rejects the
model tokens by how far the two disagree, as verl's ``algorithm.rollout_correction``
(``verl/trainer/ppo/rollout_corr_helper.py``) and slime's ``--use-tis --tis-clip --tis-clip-low``
(``slime/backends/megatron_utils/loss.py: vanilla_tis_function``; rejection in
``examples/train_infer_mismatch_helper/mis.py``) do. Per model token ``t`` of a row::

    d_t   = clamp(old_t - engine_t, -20, 20)      log-ratio (verl's SAFETY_BOUND)
    rho_t = exp(d_t)                              token weight pi_learner / pi_engine
    S     = sum_t d_t,  G = mean_t d_t            over the row's loss tokens (clamped to +-20 too)

``trainer.correction.mode`` (``low`` / ``high`` the bounds; the weight multiplies each token's
clipped surrogate, detached, in :class:`megatron_tir.rl.PolicyLoss`; KL and entropy terms are
not weighted):

=========  ==========================================================  =====================================
mode       weight, rejection                                           upstream
=========  ==========================================================  =====================================
none       w = 1 (the metrics only)                                    --
tis        w_t = clip(rho_t, low, high)                                slime ``--use-tis``; verl
                                                                       ``rollout_is=token`` (upper clip only)
seq_tis    w_t = clip(exp(S), low, high) on every token of the row     verl ``rollout_is=sequence``
mis        w_t = rho_t; tokens with rho_t outside [low, high] leave    slime ``mis.py`` (``mis_mode=mask``,
           the loss mask (numerator and denominator)                   token); verl ``rollout_rs=token``
seq_mis    w = exp(S); rows with exp(S) outside [low, high] leave      ``mis_level=sequence``; verl
                                                                       ``rollout_rs=sequence``
geo_rs     w = 1; rows with exp(G) outside [low, high] leave           verl ``rollout_rs=geometric``
=========  ==========================================================  =====================================

``low`` defaults to 0 for the IS modes (slime's ``--tis-clip-low`` default: no lower clip) and to
``1 / high`` for the rejection modes (verl's ``rollout_rs_threshold_lower`` default); ``auto`` is
``none`` in synchronous training and, in the asynchronous modes (where the gap includes the weights'
staleness), what the deprecated ``trainer.async.correction`` / ``trainer.async.cap`` say: by default
``tis`` with ``high`` 2 and ``low`` 0, the decoupled objective's truncated weight. With identical log-probs every weight is exactly 1 and
nothing is rejected (``low <= 1 <= high``).

``token_veto`` (verl ``rollout_token_veto_threshold``: step 4 of
``compute_rollout_correction_and_rejection_mask``; default None, off), with every mode: a row any of
whose loss tokens has an unclamped ``old_t - engine_t < log(token_veto)`` leaves the loss entirely
(its tokens count as rejected, their weights 0), whatever the mode decided for the rest.

``batch_normalize`` (verl ``rollout_is_batch_normalize`` in ``compute_rollout_correction_weights``;
tis / seq_tis only): the truncated weights divided by their mean over the step's loss tokens (tis) or
rows, one weight a row (seq_tis), so that mean is 1 (a mean <= 1e-8 leaves them, as verl). The sum and
the count are all-reduced over the data-parallel group (``local_rows``: as verl's
``distributed_masked_mean`` and the loss's token count), so every replica divides by the same batch
mean. The mean runs over the tokens the veto kept (verl normalises before its veto).

Metrics (every mode, ``none`` included; :mod:`megatron_tir.rl.correction_metrics` says each one): the
log-ratio (``log_ratio_mean``, ``log_ratio_abs_mean`` / ``_max``), ``k3_kl``, the chi-square
estimates ``chi2_token`` / ``chi2_seq`` and the perplexities ``learner_ppl`` / ``engine_ppl`` /
``log_ppl_diff`` (verl's ``compute_offpolicy_metrics``), ``weight_mean`` / ``weight_max``,
``clipped_share``, ``rejected_share``, ``veto_share``, ``batch_norm_factor`` (the mean divided by) and
per turn ``K`` (turn 0 is before any tool output) ``k3_kl_turn_K`` / ``log_ratio_abs_mean_turn_K``.
They come as sums and counts (``means``) and maxima, so they add up over data-parallel replicas.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from megatron_tir.rl.correction_metrics import SAFETY_BOUND, add_metrics  # SAFETY_BOUND: also slime mis.py's

IS_MODES = ("tis", "seq_tis")  # the weight is truncated
REJECTION_MODES = ("mis", "seq_mis", "geo_rs")  # tokens or rows outside [low, high] leave the loss
CORRECTION_MODES = ("none", *IS_MODES, *REJECTION_MODES)
# the former trainer.async.correction values (deprecated aliases): clamp = min(w, cap), mask = w > cap leaves
ASYNC_ALIASES = {"clamp": "tis", "mask": "mis", "off": "none"}
# the former offpolicy/* metrics (trainer.async != off; deprecated) -> the correction/* metric they are
LEGACY_METRICS = {"weight_mean": "weight_mean", "weight_max": "weight_max", "abs_dlogp_mean": "log_ratio_abs_mean",
                  "kl": "k3_kl"}


@dataclass(kw_only=True, slots=True)
class CorrectionConfig:
    """The rollout correction (``trainer.correction.KEY``; :mod:`megatron_tir.rl.correction`): the engine's
    log-probs of the model tokens against the learner's recompute, in every ``trainer.async`` mode;
    importance weights truncated to [low, high] (tis, seq_tis) or the tokens / rows outside it
    rejected (mis, seq_mis, geo_rs). Its ``correction/*`` metrics are logged every step, also with none."""
    # auto (none with trainer.async=off; otherwise trainer.async.correction at trainer.async.cap: tis at 2 by
    # default) | none | tis | seq_tis | mis | seq_mis | geo_rs
    mode: str = "auto"
    high: float = 2.0  # upper bound of the weight (tis: the truncation C, slime --tis-clip; mis: the rejection bound)
    low: float | None = None  # lower bound; None: 0 for tis / seq_tis (no lower clip), 1 / high for the rejections
    # catastrophic-token veto (verl rollout_token_veto_threshold), every mode: a row any of whose loss tokens has
    # rho < token_veto leaves the loss entirely; in (0, 1]; None: off
    token_veto: float | None = None
    # tis / seq_tis: the truncated weights divided by their mean over the step's loss tokens (tis) or rows (seq_tis),
    # summed over every data-parallel replica, so that mean is 1 (verl rollout_is_batch_normalize)
    batch_normalize: bool = False

    def __post_init__(self) -> None:
        if self.mode not in ("auto", *CORRECTION_MODES):
            raise ValueError(f"mode must be one of auto, {', '.join(CORRECTION_MODES)}, got {self.mode!r}")
        if not self.high >= 1:
            raise ValueError(f"high must be >= 1 (a weight of 1 is never corrected), got {self.high}")
        if self.low is not None and not 0 <= self.low <= 1:
            raise ValueError(f"low must be in [0, 1] (a weight of 1 is never corrected), got {self.low}")
        if self.token_veto is not None and not 0 < self.token_veto <= 1:
            raise ValueError(f"token_veto must be in (0, 1] (a weight of 1 is never vetoed) or None, "
                             f"got {self.token_veto}")
        if self.batch_normalize and self.mode not in IS_MODES:
            raise ValueError(f"batch_normalize needs mode tis or seq_tis (it normalises their weights), "
                             f"got mode={self.mode}")

    @property
    def lower(self) -> float:
        """``low`` as the mode uses it."""
        if self.low is not None:
            return self.low
        return 0.0 if self.mode in IS_MODES else 1.0 / self.high

    def resolved(self, async_mode: str, async_correction: str = "clamp", async_cap: float = 2.0) -> CorrectionConfig:
        """This config with ``auto`` decided: ``none`` with ``trainer.async=off``, otherwise what the deprecated
        ``trainer.async.correction`` / ``trainer.async.cap`` say (by default clamp at 2: ``tis``, high 2, low 0)."""
        if self.mode != "auto":
            return self
        mode = CorrectionConfig(mode="none") if async_mode == "off" else from_async_alias(async_correction, async_cap)
        return dataclasses.replace(mode, token_veto=self.token_veto)  # the veto goes with every mode

    def check_async_alias(self, async_correction: str, async_cap: float) -> None:
        """ValueError where this config and the deprecated ``trainer.async.correction`` / ``cap`` both say
        something (they are read for ``auto`` only; ``high`` / ``low`` for an explicit mode only)."""
        if self.mode != "auto":
            if (async_correction, async_cap) != DEPRECATED_DEFAULTS:
                raise ValueError(f"trainer.async.correction / trainer.async.cap are the deprecated spelling of "
                                 f"trainer.correction; with trainer.correction.mode={self.mode} leave them unset")
        elif self.high != 2.0 or self.low is not None:
            raise ValueError("correction.high / correction.low need an explicit correction.mode (auto is none, or "
                             "in the async modes trainer.async.correction at trainer.async.cap)")


DEPRECATED_DEFAULTS = ("clamp", 2.0)  # trainer.async.correction / trainer.async.cap when unset


def from_async_alias(correction: str, cap: float) -> CorrectionConfig:
    """The correction the deprecated ``trainer.async.correction`` / ``trainer.async.cap`` mean (``low`` 0:
    the former weights had no lower bound)."""
    if correction not in ASYNC_ALIASES:
        raise ValueError(f"off-policy correction must be one of {', '.join(ASYNC_ALIASES)}, got {correction!r}")
    if not cap >= 1:
        raise ValueError(f"the behaviour-weight cap must be >= 1, got {cap}")
    return CorrectionConfig(mode=ASYNC_ALIASES[correction], high=cap, low=0.0)


@dataclass(kw_only=True, slots=True)
class Correction:
    """One step's correction of a batch (detached; computed once: ``old`` and ``engine`` are fixed for the step)."""
    weights_BT: torch.Tensor | None  # the weight per token; None: every weight 1 (none, geo_rs)
    loss_mask_BT: torch.Tensor  # the loss mask with the rejected tokens out
    rho_BT: torch.Tensor  # the untruncated weight of the mode's level (token, row, geometric) per token
    clipped_BT: torch.Tensor  # bool: the weight was truncated
    rejected_BT: torch.Tensor  # bool: the token left the loss
    means: dict[str, tuple[float, float]] = field(default_factory=dict)  # metric -> (sum, count)
    maxima: dict[str, float] = field(default_factory=dict)

    def extras(self) -> dict[str, torch.Tensor]:
        """What the loss reads (``TrainBatch.extras``): the new loss mask and, unless every weight is 1,
        ``behaviour_weights_BT``."""
        out = {"loss_mask_BT": self.loss_mask_BT}
        if self.weights_BT is not None:
            out["behaviour_weights_BT"] = self.weights_BT
        return out


def correct(old_logprobs_BT: torch.Tensor, engine_logprobs_BT: torch.Tensor, loss_mask_BT: torch.Tensor,
            config: CorrectionConfig, *, turn_index_BT: torch.Tensor | None = None,
            local_rows: bool = False) -> Correction:
    """The correction ``config`` (resolved: not ``auto``) of the loss tokens (``loss_mask_BT > 0``) and its
    metrics; ``turn_index_BT``: the turn of each model token (-1 elsewhere) for the per-turn metrics;
    ``local_rows``: the rows are this data-parallel replica's share (``batch_normalize`` sums over the group:
    every replica's rank calls this)."""
    mode = config.mode
    if mode not in CORRECTION_MODES:
        raise ValueError(f"correction mode must be one of {', '.join(CORRECTION_MODES)}, got {mode!r}")
    on_BT = loss_mask_BT > 0
    on = on_BT.float()
    raw_BT = (old_logprobs_BT.float() - engine_logprobs_BT.float()).detach()
    raw_BT = torch.where(on_BT, raw_BT, torch.zeros_like(raw_BT))  # padding / feedback log-probs are not the engine's
    d_BT = raw_BT.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    if mode in ("seq_tis", "seq_mis"):
        level_BT = (d_BT * on).sum(1, keepdim=True).clamp(-SAFETY_BOUND, SAFETY_BOUND).expand_as(d_BT)
    elif mode == "geo_rs":
        level_BT = ((d_BT * on).sum(1, keepdim=True) / on.sum(1, keepdim=True).clamp_min(1)).expand_as(d_BT)
    else:
        level_BT = d_BT
    rho_BT = torch.exp(level_BT)
    low, high = config.lower, config.high
    outside_BT = ((rho_BT < low) | (rho_BT > high)) & on_BT
    none_BT = torch.zeros_like(on_BT)
    weights_BT, clipped_BT, rejected_BT = None, none_BT, none_BT
    if mode in IS_MODES:
        weights_BT, clipped_BT = rho_BT.clamp(low, high), outside_BT
    elif mode in REJECTION_MODES:
        rejected_BT = outside_BT
        if mode != "geo_rs":
            weights_BT = rho_BT
    vetoed_B = torch.zeros(on_BT.shape[0], dtype=torch.bool, device=on_BT.device)
    if config.token_veto is not None:  # verl: the unclamped log-ratio below log(threshold), on a loss token
        vetoed_B = ((raw_BT < math.log(config.token_veto)) & on_BT).any(1)
        rejected_BT = rejected_BT | (vetoed_B[:, None] & on_BT)
        clipped_BT = clipped_BT & ~rejected_BT
    mask_BT = loss_mask_BT * (~rejected_BT).to(loss_mask_BT.dtype)
    if weights_BT is not None:
        weights_BT = torch.where(rejected_BT, torch.zeros_like(weights_BT), weights_BT)
    factor = None
    if config.batch_normalize:
        weights_BT, factor = _batch_normalize(weights_BT, on_BT & ~rejected_BT, row_level=mode == "seq_tis",
                                              local_rows=local_rows)
    out = Correction(weights_BT=weights_BT, loss_mask_BT=mask_BT, rho_BT=rho_BT, clipped_BT=clipped_BT,
                     rejected_BT=rejected_BT)
    if bool(on_BT.any()):
        add_metrics(out.means, out.maxima, old_logprobs_BT=old_logprobs_BT, engine_logprobs_BT=engine_logprobs_BT,
                    d_BT=d_BT, on_BT=on_BT, rho_BT=rho_BT, weights_BT=weights_BT, clipped_BT=clipped_BT,
                    rejected_BT=rejected_BT, vetoed_B=vetoed_B, turn_index_BT=turn_index_BT)
        if factor is not None:
            out.maxima["batch_norm_factor"] = factor
    return out


def _batch_normalize(weights_BT: torch.Tensor, kept_BT: torch.Tensor, *, row_level: bool,
                     local_rows: bool) -> tuple[torch.Tensor, float]:
    """``weights_BT`` over their mean on the kept tokens (``row_level``: the kept rows' weights, one a row),
    summed over the data-parallel group with ``local_rows``; the weights unchanged where that mean is at
    most 1e-8 (verl). Returns the weights and the mean divided by."""
    if row_level:  # every kept token of a row carries the row's weight
        rows_B = kept_BT.any(1)
        w_B = (weights_BT * kept_BT).sum(1) / kept_BT.sum(1).clamp_min(1)
        totals = torch.stack([w_B[rows_B].double().sum(), rows_B.double().sum()])
    else:
        totals = torch.stack([weights_BT[kept_BT].double().sum(), kept_BT.double().sum()])
    if local_rows and torch.distributed.is_initialized():
        from megatron.core import parallel_state

        if parallel_state.get_data_parallel_world_size() > 1:  # every replica's rows: one mean, the same factor
            group = parallel_state.get_data_parallel_group()  # NCCL needs the operand on this rank's GPU
            nccl = torch.distributed.get_backend(group) == "nccl"
            totals = totals.to(torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu")
            torch.distributed.all_reduce(totals, group=group)
    total, count = totals.tolist()
    mean = total / count if count else 0.0
    if not mean > 1e-8:
        return weights_BT, 1.0
    return weights_BT / mean, mean


def named_stats(c: Correction, *, legacy: bool = False) -> tuple[dict[str, tuple[float, float]], dict[str, float]]:
    """``c``'s metrics as ``correction/*`` means (sum, count) and maxima; ``legacy`` (``trainer.async`` other
    than off) adds the former ``offpolicy/*`` names (deprecated; ``capped_share`` = clipped + rejected)."""
    means = {f"correction/{k}": v for k, v in c.means.items()}
    maxima = {f"correction/{k}": v for k, v in c.maxima.items()}
    if legacy and c.means:
        for old, new in LEGACY_METRICS.items():
            if new in c.means:
                means[f"offpolicy/{old}"] = c.means[new]
            elif new in c.maxima:
                maxima[f"offpolicy/{old}"] = c.maxima[new]
        (clipped, n), (rejected, _) = c.means["clipped_share"], c.means["rejected_share"]
        means["offpolicy/capped_share"] = (clipped + rejected, n)
    return means, maxima

"""The policy loss: the clipped surrogate (clip-low / clip-high, dual clip), KL and entropy terms,
the two aggregations, and the per-token loss function that ``megatron_tir.policy.losses.TokenLoss``
hands to ``Learner.train_step``.

Per token, with ratio ``rho = exp(logp - logp_old)`` and advantage ``A``::

    l = max(-A * rho, -A * clip(rho, 1 - clip_low, 1 + clip_high))      (PPO, DAPO clip-higher)
    l = min(l, -A * dual_clip)               where A < 0                (dual clip, c = 3)
    l += kl_coef * k3(logp, logp_ref) - entropy_coef * H                (both off by default)

Aggregation (the Learner does it across micro-batches and DP ranks; :func:`aggregate` is the
reference): ``seq_mean`` is the paper's Eq. 1 -- each trajectory's mean over its loss tokens,
then the mean over trajectories; ``token_mean`` is the sum over all loss tokens of the
mini-batch divided by their count; ``microbatch_token_mean`` is SimpleTIR's released fork (verl's
``dp_actor.update_policy`` under ``use_dynamic_bsz``: each micro-batch's token mean times its rows
over the mini-batch's rows, summed over the micro-batches -- the micro-batches being the learner's,
binned by ``learner.max_tokens_per_microbatch``).

Denominator (``denominator``, with ``token_mean``): ``model_tokens`` divides by the loss tokens;
``response_tokens`` by every response token of the mini-batch's trained rows, the tool's output
included (ZeroTIR's script: ``masked_sum(loss, env_mask) / length_status["response_length"]`` with
``--use_prefetch``). Both non-default rules reach the Learner's ``token_mean`` through one detached
per-row factor, ``extras["loss_scale_B"]`` (:func:`loss_scale_B`, computed per mini-batch over every
replica's rows by ``megatron_tir.train.loss_scale``), so the Learner keeps its two aggregations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AGGREGATIONS = ("token_mean", "seq_mean")  # the Learner's
LOSS_AGGREGATIONS = (*AGGREGATIONS, "microbatch_token_mean")  # trainer.loss.aggregation
DENOMINATORS = ("model_tokens", "response_tokens")
SCALE_EXTRA = "loss_scale_B"  # the per-row factor of the two rules above
# the per-token metric by which a loss says which tokens it kept (``Learner.train_step``: tokens with
# keep 0 leave the loss and its denominator, as if they had been out of the loss mask from the start)
KEEP_METRIC = "loss_keep"


@dataclass(kw_only=True, slots=True)
class LossConfig:
    clip_low: float = 0.2  # PPO ratio clip below 1 (1 - clip_low)
    clip_high: float = 0.28  # PPO ratio clip above 1 (1 + clip_high; DAPO's clip-higher)
    dual_clip: float | None = 3.0  # None: off
    kl_coef: float = 0.0  # > 0: the trainer builds a frozen reference learner for ref_logprobs_BT
    entropy_coef: float = 0.0  # entropy bonus in the loss (0: off)
    # token_mean | seq_mean (Eq. 1) | microbatch_token_mean (SimpleTIR's fork: per micro-batch token mean x its rows
    # over the mini-batch's rows)
    aggregation: str = "token_mean"
    # token_mean's denominator: model_tokens (the loss tokens) | response_tokens (all response tokens of the trained
    # rows, tool output included: ZeroTIR's script)
    denominator: str = "model_tokens"

    def __post_init__(self) -> None:
        if not 0 < self.clip_low < 1:
            raise ValueError(f"clip_low must be in (0, 1), got {self.clip_low}")
        if self.clip_high <= 0:
            raise ValueError(f"clip_high must be > 0, got {self.clip_high}")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1 (or null), got {self.dual_clip}")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError("kl_coef and entropy_coef must be >= 0")
        if self.aggregation not in LOSS_AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {', '.join(LOSS_AGGREGATIONS)}, got {self.aggregation!r}")
        if self.denominator not in DENOMINATORS:
            raise ValueError(f"denominator must be one of {', '.join(DENOMINATORS)}, got {self.denominator!r}")
        if self.denominator != "model_tokens" and self.aggregation != "token_mean":
            raise ValueError(f"denominator={self.denominator} needs aggregation=token_mean, got {self.aggregation}")

    @property
    def learner_aggregation(self) -> str:
        """The Learner's aggregation (``token_mean`` under the per-row factor of the other rules)."""
        return self.aggregation if self.aggregation in AGGREGATIONS else "token_mean"

    @property
    def scaled(self) -> bool:
        """Whether the loss takes the per-row factor ``extras[SCALE_EXTRA]`` (:func:`loss_scale_B`)."""
        return self.aggregation == "microbatch_token_mean" or self.denominator != "model_tokens"


def loss_scale_B(cfg: LossConfig, loss_tokens: float, rows: float, response_tokens: float) -> float:
    """The per-row factor of a mini-batch with these totals (over every replica's rows): under the
    Learner's ``token_mean`` (loss / ``loss_tokens``) it turns the loss into ``loss / response_tokens``
    (``denominator=response_tokens``), or, times ``rows_mb / tokens_mb`` per micro-batch
    (:meth:`PolicyLoss.__call__`), into the sum over micro-batches of ``rows_mb / rows`` times the
    micro-batch's token mean (``microbatch_token_mean``)."""
    if cfg.aggregation == "microbatch_token_mean":
        return loss_tokens / max(rows, 1.0)
    if cfg.denominator == "response_tokens":
        return loss_tokens / max(response_tokens, 1.0)
    return 1.0


def clipped_surrogate_BT(logprobs_BT: torch.Tensor, old_logprobs_BT: torch.Tensor, advantages_BT: torch.Tensor, *,
                         clip_low: float, clip_high: float, dual_clip: float | None
                         ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token clipped surrogate loss and per-token indicators (float 0/1):
    ``clip_low`` (A < 0 and rho < 1 - clip_low), ``clip_high`` (A > 0 and rho > 1 + clip_high),
    ``dual_clip`` (A < 0 and -A * rho exceeds -A * c), plus ``ratio``."""
    ratio_BT = torch.exp((logprobs_BT - old_logprobs_BT).clamp(-20.0, 20.0))
    unclipped = -advantages_BT * ratio_BT
    clipped = -advantages_BT * ratio_BT.clamp(1 - clip_low, 1 + clip_high)
    loss_BT = torch.maximum(unclipped, clipped)
    neg = advantages_BT < 0
    dual_BT = torch.zeros_like(neg)
    if dual_clip is not None:
        cap = -advantages_BT * dual_clip
        dual_BT = neg & (loss_BT > cap)
        loss_BT = torch.where(dual_BT, cap, loss_BT)
    r = ratio_BT.detach()
    metrics = {
        "ratio": r,
        "clip_low": (neg & (r < 1 - clip_low)).float(),
        "clip_high": ((advantages_BT > 0) & (r > 1 + clip_high)).float(),
        "dual_clip": dual_BT.float(),
    }
    return loss_BT, metrics


def kl_k3_BT(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor) -> torch.Tensor:
    """The k3 estimator of KL(pi || pi_ref) per token: ``exp(d) - d - 1`` with ``d = ref - logp`` (>= 0)."""
    d = (ref_logprobs_BT - logprobs_BT).clamp(-20.0, 20.0)
    return torch.exp(d) - d - 1


def aggregate(loss_BT: torch.Tensor, mask_BT: torch.Tensor, aggregation: str) -> torch.Tensor:
    """Reference aggregation of a per-token loss over ``mask_BT`` (the Learner's contract)."""
    mask_BT = mask_BT.float()
    if aggregation == "token_mean":
        return (loss_BT * mask_BT).sum() / mask_BT.sum().clamp(min=1)
    if aggregation == "seq_mean":
        n_B = mask_BT.sum(1)
        rows = n_B > 0
        per_row = (loss_BT * mask_BT).sum(1)[rows] / n_B[rows]
        return per_row.mean() if rows.any() else loss_BT.sum() * 0
    raise ValueError(f"aggregation must be one of {', '.join(AGGREGATIONS)}, got {aggregation!r}")


class PolicyLoss:
    """The Learner's ``LossFn``: ``(logprobs_BT, entropy_BT | None, extras) -> (loss_BT, metrics_BT)``.

    ``extras`` holds ``old_logprobs_BT`` and ``advantages_BT`` (and ``ref_logprobs_BT`` when
    ``kl_coef > 0``). With ``behaviour_weights_BT`` (asynchronous training's off-policy
    correction, :mod:`megatron_tir.rl.correction`; ``old_logprobs_BT`` is then the proximal
    policy) the clipped surrogate of each token is multiplied by its detached weight; without
    it nothing is multiplied (synchronous training's loss, bit for bit).
    ``max_ratio_tensor`` keeps the largest importance ratio seen on loss tokens since
    :meth:`reset` (the Learner reports means only), on the device of the loss and without
    reading it to the host (no synchronisation per micro-batch); ``max_ratio`` reads it (once
    per step). ``high_ratio_bound`` (mode high_ratio_filter): tokens whose ratio exceeds it get
    no loss (no surrogate, KL or entropy term) and leave the aggregation's denominator: the loss
    reports them as ``KEEP_METRIC`` 0, so the step equals one with them out of the loss mask
    (the low-prob filter's way, decided before the step; the ratio is known only in the forward).
    """

    def __init__(self, config: LossConfig, *, high_ratio_bound: float | None = None) -> None:
        assert high_ratio_bound is None or high_ratio_bound > 1
        self.config = config
        self.high_ratio_bound = high_ratio_bound
        self.max_ratio_tensor: torch.Tensor | None = None  # 0-dim, on the loss's device; None: no loss token yet

    def reset(self) -> None:
        self.max_ratio_tensor = None

    @property
    def entropy_needs_grad(self) -> bool:
        """Whether the gradient goes through the entropy (``TokenLoss`` computes a diagnostic entropy
        without autograd otherwise)."""
        return self.config.entropy_coef > 0

    @property
    def max_ratio(self) -> float:
        """The largest ratio on loss tokens since :meth:`reset` (0 before any): a host read."""
        return 0.0 if self.max_ratio_tensor is None else float(self.max_ratio_tensor)

    def __call__(self, logprobs_BT: torch.Tensor, entropy_BT: torch.Tensor | None,
                 extras: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg = self.config
        loss_BT, metrics = clipped_surrogate_BT(logprobs_BT, extras["old_logprobs_BT"], extras["advantages_BT"],
                                                clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                                                dual_clip=cfg.dual_clip)
        if "behaviour_weights_BT" in extras:
            w_BT = extras["behaviour_weights_BT"].detach()
            loss_BT = loss_BT * w_BT
            metrics["behaviour_weight"] = w_BT.float()
        if "loss_mask_BT" in extras:  # ratios are > 0: masked tokens count as 0
            seen = torch.where(extras["loss_mask_BT"] > 0, metrics["ratio"], 0.0).max()
            prev = self.max_ratio_tensor
            self.max_ratio_tensor = seen if prev is None else torch.maximum(prev, seen)
        if cfg.kl_coef > 0:
            kl_BT = kl_k3_BT(logprobs_BT, extras["ref_logprobs_BT"])
            loss_BT = loss_BT + cfg.kl_coef * kl_BT
            metrics["kl"] = kl_BT.detach()
        if cfg.entropy_coef > 0:
            if entropy_BT is None:
                raise ValueError("entropy_coef > 0 needs the entropy (TokenLoss with_entropy=True)")
            loss_BT = loss_BT - cfg.entropy_coef * entropy_BT
        if entropy_BT is not None:
            metrics["entropy"] = entropy_BT.detach()
        if cfg.scaled:  # the aggregation's or the denominator's per-row factor (module docstring)
            loss_BT = loss_BT * _row_factor_BT(cfg, extras)
        if self.high_ratio_bound is not None:  # last: a filtered token has no term of the loss at all
            high_BT = metrics["ratio"] > self.high_ratio_bound
            loss_BT = torch.where(high_BT, torch.zeros_like(loss_BT), loss_BT)
            metrics["high_ratio_masked"] = high_BT.float()
            metrics[KEEP_METRIC] = (~high_BT).float()
        return loss_BT, metrics


def _row_factor_BT(cfg: LossConfig, extras: dict[str, torch.Tensor]) -> torch.Tensor:
    if SCALE_EXTRA not in extras:
        raise ValueError(f"trainer.loss aggregation={cfg.aggregation} / denominator={cfg.denominator} needs "
                         f"extras[{SCALE_EXTRA!r}] (megatron_tir.train.loss_scale.add_loss_scales)")
    factor_B = extras[SCALE_EXTRA].detach().float()
    if cfg.aggregation == "microbatch_token_mean":  # this micro-batch's rows over its loss tokens
        mask_BT = extras["loss_mask_BT"].float()
        factor_B = factor_B * (mask_BT.sum(1) > 0).float().sum() / mask_BT.sum().clamp(min=1.0)
    return factor_B[:, None]

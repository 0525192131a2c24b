"""PPO with a masked critic (ZeroTIR): GAE advantages from the critic's values, the value-loss
step, KL in the reward, and the critic's config.

With ``trainer.ppo.advantage = "gae"`` the trainer builds a critic (``LearnerConfig.head =
"value"``: the policy's GPTModel with a one-output head, same TP/PP, its backbone from the
policy's weights or ``critic.model``) with its own optimizer and lr. Per step:

1. ``old values`` of the update's rows (critic forward);
2. per-token rewards: the outcome reward on each row's last model token, minus
   ``kl_reward_coef`` * k1(behaviour vs reference) on model tokens (KL in the reward, as
   OpenRLHF / ZeroTIR; the KL *loss* is ``trainer.loss.kl_coef``, a separate switch);
3. GAE over **model tokens only** (``megatron_tir.rl.critic.gae_BT``: feedback tokens are not
   steps and get neither advantage nor value loss -- value masking; ``gae_across_feedback``: whether
   the running advantage crosses a feedback span or restarts there), then the advantages are
   normalised over the batch's model tokens (``critic.whiten``: ``batch`` centres and scales, as
   verl's ``masked_whiten`` and OpenRLHF do; ``rms`` only divides by their root mean square,
   keeping each token's sign -- the critic is the baseline --, which is what a mode that drops
   void rows needs: their rewards are not in the update's rows, so centring on the rows left
   (one correct row, say) erases the signal the void filter kept; ``off``);
4. per mini-batch: one critic step on the clipped value loss, with the same row roles as the
   policy loss (``megatron_tir.rl.rows``: the update batch already holds only the rows and
   tokens the mode trains), then the policy step -- except in the first ``warmup_steps`` steps
   (critic-only warm-up; with ``filter_in_warmup`` false the group filter is off in those steps:
   :func:`warmup_unfiltered`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_tir.policy.learner_contract import TrainBatch
from megatron_tir.rl.loss import AGGREGATIONS
from megatron_tir.rl.critic import GAE_ACROSS_FEEDBACK, gae_BT, token_rewards_BT
from megatron_tir.train.row_stats import RowStats


@dataclass(kw_only=True, slots=True)
class CriticConfig:
    """The critic of ``trainer.ppo.advantage=gae`` (ignored otherwise)."""
    model: str | None = None  # None: the policy's weights (its HF dir or checkpoint)
    lr: float = 1e-5  # the critic's learning rate
    warmup_steps: int = 0  # first steps train the critic only
    value_clip: float | None = 0.2  # None: unclipped value loss
    value_clip_high: float | None = None  # the value clip above the old value (None: value_clip; ZeroTIR: 0.28)
    gamma: float = 1.0  # GAE discount
    lam: float = 1.0  # GAE lambda
    # carry: the running advantage and next value cross a feedback span (verl's multi-turn GAE) | reset: a
    # feedback token zeroes both (ZeroTIR's script, ``lastgaelam *= env_mask[:, t]``); docs/training.md
    gae_across_feedback: str = "carry"
    # the value loss's aggregation (None: trainer.loss.aggregation); ZeroTIR's critic: seq_mean
    aggregation: str | None = None
    # false: the warm-up steps train the critic on every sampled group (no group filter, as ZeroTIR's fork)
    filter_in_warmup: bool = True
    kl_reward_coef: float = 0.0  # KL in the reward (k1 against the frozen reference); 0: off
    whiten: str = "batch"  # batch | rms | off: how the GAE advantages are normalised over the batch's model tokens

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.value_clip is not None and not self.value_clip > 0:
            raise ValueError(f"value_clip must be > 0 (or null), got {self.value_clip}")
        if self.value_clip_high is not None and (self.value_clip is None or not self.value_clip_high > 0):
            raise ValueError(f"value_clip_high must be > 0 and needs value_clip, got {self.value_clip_high}")
        if self.gae_across_feedback not in GAE_ACROSS_FEEDBACK:
            raise ValueError(f"gae_across_feedback must be one of {', '.join(GAE_ACROSS_FEEDBACK)}, "
                             f"got {self.gae_across_feedback!r}")
        if self.aggregation is not None and self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {', '.join(AGGREGATIONS)} or null, got {self.aggregation!r}")
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
            raise ValueError(f"gamma and lam must be in [0, 1], got {self.gamma}, {self.lam}")
        if self.kl_reward_coef < 0:
            raise ValueError(f"kl_reward_coef must be >= 0, got {self.kl_reward_coef}")
        if self.whiten not in WHITEN:
            raise ValueError(f"whiten must be one of {', '.join(WHITEN)}, got {self.whiten!r}")


WHITEN = ("batch", "rms", "off")


def warmup_unfiltered(cfg: CriticConfig, *, uses_critic: bool, step: int) -> bool:
    """Whether step ``step`` (1-based) samples without the group filter: a critic-only warm-up step with
    ``filter_in_warmup`` false (ZeroTIR's fork runs its accuracy and eval filters only once the actor
    trains: ``steps > freezing_actor_steps``, ``ppo_trainer.py`` 260)."""
    return uses_critic and not cfg.filter_in_warmup and step <= cfg.warmup_steps


def _whiten(x_BT: torch.Tensor, mask_BT: torch.Tensor, eps: float = 1e-8, *, local_rows: bool = False,
            centre: bool = True) -> torch.Tensor:
    """Whitened over the masked entries of the batch (``local_rows``: of every data-parallel
    replica's rows); ``centre=False``: divided by their root mean square only (signs kept; a
    constant row stays a constant of magnitude 1, where centring would make it 0)."""
    m = mask_BT.float()
    sums = torch.stack([m.sum(), (x_BT * m).sum(), (x_BT * x_BT * m).sum()]).double()
    if local_rows and torch.distributed.is_initialized():
        from megatron.core import parallel_state

        from megatron_tir.policy.parallel import collective_device

        if parallel_state.get_data_parallel_world_size() > 1:
            sums = sums.to(collective_device())
            torch.distributed.all_reduce(sums, group=parallel_state.get_data_parallel_group())
            sums = sums.cpu()
    n = sums[0].clamp(min=1)
    if not centre:
        return (x_BT * torch.rsqrt(sums[2] / n + eps) * m).float()
    mean = sums[1] / n
    var = (sums[2] / n - mean * mean).clamp(min=0)
    return ((x_BT - mean) * torch.rsqrt(var + eps) * m).float()


def gae_advantages(batch: TrainBatch, rewards_B: torch.Tensor, values_BT: torch.Tensor, cfg: CriticConfig, *,
                   model_mask_BT: torch.Tensor, behaviour_BT: torch.Tensor | None = None,
                   ref_BT: torch.Tensor | None = None, local_rows: bool = False) -> tuple[TrainBatch, RowStats]:
    """``batch`` (the update's rows) with GAE ``advantages_BT``, ``returns_BT`` and
    ``old_values_BT`` in its extras, and the metrics' sums (:func:`critic_metrics` finishes them,
    after :func:`~megatron_tir.train.row_stats.reduce_over_replicas` with ``local_rows``).
    ``values_BT``: the critic's values of the rows; ``model_mask_BT``: the rows' model-token mask
    (before any token filter: the MDP's steps); ``rewards_B`` the rows' outcome rewards."""
    values_BT = values_BT * model_mask_BT
    if cfg.kl_reward_coef > 0 and (behaviour_BT is None or ref_BT is None):
        raise ValueError("critic.kl_reward_coef > 0 needs the behaviour and the reference log-probs")
    rewards_BT = token_rewards_BT(rewards_B, model_mask_BT, logprobs_BT=behaviour_BT, ref_logprobs_BT=ref_BT,
                                  kl_coef=cfg.kl_reward_coef)
    adv_BT, returns_BT = gae_BT(rewards_BT, values_BT, model_mask_BT, gamma=cfg.gamma, lam=cfg.lam,
                                across_feedback=cfg.gae_across_feedback)
    if cfg.whiten != "off":
        adv_BT = _whiten(adv_BT, batch.loss_mask_BT, local_rows=local_rows, centre=cfg.whiten == "batch")
    extras = dict(batch.extras, advantages_BT=adv_BT * batch.loss_mask_BT, returns_BT=returns_BT,
                  old_values_BT=values_BT)
    on = model_mask_BT > 0
    correct = (rewards_B > 0)[:, None].expand_as(on) & on
    stats = RowStats(maxima={"critic/kl_in_reward": float(cfg.kl_reward_coef > 0)})
    ret, err = returns_BT.float()[on], (returns_BT.float() - values_BT.float())[on]
    for name, values in (("critic/value_mean", values_BT[on]), ("critic/value_mean_correct", values_BT[correct]),
                         ("critic/value_mean_wrong", values_BT[on & ~correct]), ("critic/return_mean", ret),
                         ("\0ret2", ret * ret), ("\0err", err), ("\0err2", err * err)):
        stats.add_mean(name, values)
    if cfg.kl_reward_coef > 0:
        stats.add_mean("critic/kl_k1_mean", (behaviour_BT - ref_BT)[on])
    return TrainBatch(tokens_BT=batch.tokens_BT, attention_mask_BT=batch.attention_mask_BT,
                      loss_mask_BT=batch.loss_mask_BT, extras=extras), stats


def critic_metrics(stats: RowStats) -> dict[str, float]:
    """The critic's metrics of the whole batch from the (reduced) sums of :func:`gae_advantages`:
    means over model tokens (of the rows with a positive / non-positive reward: NaN when there is
    none), and the explained variance ``1 - Var[R - V] / Var[R]`` (as :func:`megatron_tir.rl.critic.explained_variance`)."""
    if "critic/kl_in_reward" not in stats.maxima:
        return {}
    ret, ret2 = stats.mean("critic/return_mean"), stats.mean("\0ret2")
    err, err2 = stats.mean("\0err"), stats.mean("\0err2")
    var_r, var_e = max(ret2 - ret * ret, 0.0), max(err2 - err * err, 0.0)
    # returns that do not vary (to rounding of the sums): nothing to explain, NaN as explained_variance
    explained = 1.0 - var_e / var_r if var_r > 1e-9 * max(ret2, 1e-12) else float("nan")
    out = {"critic/explained_variance": explained,
           "critic/value_mean": stats.mean("critic/value_mean"),
           "critic/value_mean_correct": stats.mean("critic/value_mean_correct", float("nan")),
           "critic/value_mean_wrong": stats.mean("critic/value_mean_wrong", float("nan")),
           "critic/return_mean": ret, "critic/kl_in_reward": stats.maxima["critic/kl_in_reward"]}
    if "critic/kl_k1_mean" in stats.means:
        out["critic/kl_k1_mean"] = stats.mean("critic/kl_k1_mean")
    return out


def critic_step(critic, mb: TrainBatch, cfg: CriticConfig, aggregation: str, *, local_rows: bool = False) -> dict[str, float]:
    """One optimizer step of the critic on the mini-batch's value loss (its model tokens only)."""
    from megatron_tir.policy.losses import ValueLoss

    r = critic.train_step(mb, ValueLoss(clip=cfg.value_clip, clip_high=cfg.value_clip_high),
                          aggregation=cfg.aggregation or (aggregation if aggregation in AGGREGATIONS else "token_mean"),
                          local_rows=local_rows)
    if r.empty:  # every token of the mini-batch masked: no step (the same on every rank)
        return {"critic/empty": 1.0}
    return {"critic/value_loss": r.loss, "critic/grad_norm": r.grad_norm,
            "critic/value_clip_fraction": r.metrics.get("value_clipped", 0.0), "critic/skipped": float(r.skipped),
            "critic/empty": 0.0}

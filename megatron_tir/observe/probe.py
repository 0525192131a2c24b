"""Learner-side diagnostics of an update, measured inside the policy loss (every rank).

:class:`TurnProbe` wraps the policy loss (:class:`megatron_tir.rl.PolicyLoss`) and adds
per-token metrics that the learner averages over the loss tokens of each optimizer step
(token-weighted: ``sum(m * w)`` with ``w = loss_mask / loss tokens``); :meth:`TurnProbe.finish`
turns them into these step metrics:

* ``ppo_kl`` -- verl's ``ppo_kl`` (``verl/trainer/ppo/core_algos.py``,
  ``compute_policy_loss``: ``masked_mean(-(log_prob - old_log_prob))``), the k1 estimate of
  KL(old || current) on the loss tokens; ``old`` is ``trainer.ppo.old_logprobs`` (the learner's
  recompute or the behaviour policy's engine log-probs).
* ``entropy_turn_K`` -- mean entropy (nats) of the current policy's next-token distribution at
  the loss tokens of turn K (computed in every update, whatever ``entropy_coef``).
* ``ratio_mean_turn_K`` / ``ratio_max_turn_K`` -- mean and maximum importance ratio
  ``pi / pi_old`` over the loss tokens of turn K (SimpleTIR Figure 5: ratios explode in later
  turns before a collapse); the max is over every micro-batch, optimizer step and rank.

Turn K's tokens are given by ``extras["turn_index_BT"]`` (-1 outside model tokens).
"""

from __future__ import annotations

import torch


class TurnProbe:
    def __init__(self, loss_fn, n_turns: int) -> None:
        self.loss_fn = loss_fn
        self.n_turns = n_turns
        self.max_ratio_K: torch.Tensor | None = None  # on the loss's device; never read per micro-batch (no sync)

    @property
    def entropy_needs_grad(self) -> bool:  # the wrapped loss's (policy.losses.entropy_needs_grad)
        return bool(getattr(self.loss_fn, "entropy_needs_grad", True))

    def __call__(self, logprobs_BT: torch.Tensor, entropy_BT: torch.Tensor | None, extras: dict[str, torch.Tensor]):
        loss_BT, metrics = self.loss_fn(logprobs_BT, entropy_BT, extras)
        metrics["ppo_kl"] = (extras["old_logprobs_BT"] - logprobs_BT).detach()
        turn_BT = extras.get("turn_index_BT")
        if turn_BT is None:
            return loss_BT, metrics
        on_BT = extras["loss_mask_BT"] > 0
        ratio_BT = metrics["ratio"]
        maxes = []
        for k in range(self.n_turns):
            in_k = turn_BT == k
            metrics[f"tokens_turn_{k}"] = in_k.float()
            metrics[f"ratio_turn_{k}"] = ratio_BT * in_k
            if entropy_BT is not None:
                metrics[f"entropy_turn_{k}"] = entropy_BT.detach() * in_k
            maxes.append(torch.where(in_k & on_BT, ratio_BT, torch.zeros_like(ratio_BT)).amax())
        if maxes:
            seen_K = torch.stack(maxes).float()
            self.max_ratio_K = seen_K if self.max_ratio_K is None else torch.maximum(self.max_ratio_K, seen_K)
        return loss_BT, metrics

    def finish(self, means: dict[str, float]) -> dict[str, float]:
        """Replace the raw per-turn sums in ``means`` (the step's averaged train metrics, unprefixed) by
        per-turn means; add the per-turn max ratio (all-reduced). Collective when a process group is up."""
        out = {k: v for k, v in means.items() if not k.startswith(("tokens_turn_", "ratio_turn_", "entropy_turn_"))}
        max_t = self.max_ratio_K
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            from megatron_tir.policy.parallel import collective_device

            if max_t is None:  # a rank without the last pipeline stage never ran the loss
                max_t = torch.zeros(self.n_turns)
            max_t = max_t.to(collective_device())
            torch.distributed.all_reduce(max_t, op=torch.distributed.ReduceOp.MAX)
        max_t = torch.zeros(self.n_turns) if max_t is None else max_t.cpu()
        for k in range(self.n_turns):
            share = means.get(f"tokens_turn_{k}", 0.0)
            if share > 0:
                out[f"ratio_mean_turn_{k}"] = means[f"ratio_turn_{k}"] / share
                if f"entropy_turn_{k}" in means:
                    out[f"entropy_turn_{k}"] = means[f"entropy_turn_{k}"] / share
                out[f"ratio_max_turn_{k}"] = float(max_t[k])
        return out

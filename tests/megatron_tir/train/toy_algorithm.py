"""A toy Algorithm given by import path (``trainer.ppo.algorithm=toy_algorithm:ClippedAdvantages``): the
policy-gradient family with every advantage clipped to [-0.5, 0.5] on the stage that computes the loss,
reporting how many loss tokens it clipped and how many mini-batches it stepped."""

from __future__ import annotations

from megatron_tir.train.algorithm import PolicyGradient
from megatron_tir.train.row_stats import RowStats


class ClippedAdvantages(PolicyGradient):
    BOUND = 0.5

    def _advantages(self, update, rows, old_BT, ref_BT, values_BT) -> RowStats:
        adv_BT = update.batch.extras["advantages_BT"]
        on_BT = update.batch.loss_mask_BT > 0
        clipped = float(((adv_BT.abs() > self.BOUND) & on_BT).sum())
        update.batch.extras["advantages_BT"] = adv_BT.clamp(-self.BOUND, self.BOUND)
        return RowStats(totals={"toy/clipped_tokens": clipped})

    def prepare(self, step, got, timings):
        self.mini_batches = 0
        return super().prepare(step, got, timings)

    def steps(self, mb) -> None:
        super().steps(mb)
        self.mini_batches += 1

    def _family_metrics(self, s) -> dict[str, float]:
        return {"toy/clipped_tokens": s.stats.totals.get("toy/clipped_tokens", 0.0),
                "toy/mini_batches": float(self.mini_batches)}

"""From scored groups to what the Learner trains on: group filter, row roles, advantages, masks.

``RolloutTensors`` is the part of a rollout every trainer rank needs (rank 0 builds it from the
groups and broadcasts it); :func:`build_update` turns it into the ``TrainBatch`` of one step
with the rules of :mod:`megatron_tir.rl.rows` (which rows count where, the mode's filters).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from megatron_tir.policy.learner_config import TrainBatch
from megatron_tir.rl import ADVANTAGE_ESTIMATORS, MODES, group_keep_G, low_prob_keep_BT, row_weights
from megatron_tir.rl.offpolicy import correction_BT
from megatron_tir.rollout.batch import Group, collate
from megatron_tir.rollout.trajectory import FinishStatus


SAMPLING_STRATEGIES = ("rounds", "oversample")


@dataclass(kw_only=True, slots=True)
class RolloutTensors:
    tokens_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    loss_mask_BT: torch.Tensor  # per token only (collate); rows are weighted in build_update
    engine_logprobs_BT: torch.Tensor
    versions_BT: torch.Tensor  # weight version that sampled each loss token (collate); -1 elsewhere
    rewards_B: torch.Tensor
    group_index_B: torch.Tensor
    void_B: torch.Tensor
    infra_B: torch.Tensor  # tool_failed or aborted
    truncated_B: torch.Tensor
    turn_index_BT: torch.Tensor  # long: the turn index of each model token, -1 elsewhere (per-turn diagnostics)

    def as_dict(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def batch_size(self) -> int:
        return self.tokens_BT.shape[0]


def to_tensors(groups: Sequence[Group], *, pad_id: int) -> RolloutTensors:
    rb = collate(groups, pad_id=pad_id)
    trajs = [t for g in groups for t in g.trajectories]
    return RolloutTensors(
        tokens_BT=rb.tokens_BT, attention_mask_BT=rb.attention_mask_BT, loss_mask_BT=rb.loss_mask_BT,
        engine_logprobs_BT=rb.old_logprobs_BT, versions_BT=rb.versions_BT, rewards_B=rb.rewards_B, group_index_B=rb.group_index_B,
        void_B=rb.void_B,
        infra_B=torch.tensor([t.status in (FinishStatus.TOOL_FAILED, FinishStatus.ABORTED) for t in trajs]),
        truncated_B=torch.tensor([t.status is FinishStatus.TRUNCATED for t in trajs]),
        turn_index_BT=_turn_index_BT(trajs, rb.tokens_BT.shape))


def _turn_index_BT(trajs, shape) -> torch.Tensor:
    out = torch.full(shape, -1, dtype=torch.long)
    for b, t in enumerate(trajs):
        p = len(t.prompt_ids)
        for turn in t.turns:
            out[b, p + turn.start:p + turn.start + turn.model_tokens] = turn.index
    return out


def filter_groups(groups: Sequence[Group], *, drop_zero_std: bool, accuracy_lo: float, accuracy_hi: float,
                  overlong: str = "keep", min_rows: int = 1) -> tuple[list[Group], dict[str, int]]:
    """The groups the update keeps (dynamic sampling) and how many each rule removed; with
    ``overlong="drop"`` truncated rows do not count (``min_rows``: counted rows a group needs)."""
    if not groups:
        return [], {"no_counted_rows": 0, "zero_std": 0, "accuracy": 0}
    rt = to_tensors(groups, pad_id=0)
    stats_B, _ = row_weights(void_B=rt.void_B, infra_B=rt.infra_B, truncated_B=rt.truncated_B, drop_void=False,
                             overlong="drop" if overlong == "drop" else "keep")
    keep_G, removed = group_keep_G(rt.rewards_B, rt.group_index_B, stats_B, drop_zero_std=drop_zero_std,
                                   accuracy_lo=accuracy_lo, accuracy_hi=accuracy_hi, min_rows=min_rows)
    return [g for g, k in zip(groups, keep_G.tolist()) if k], removed


@dataclass(kw_only=True, slots=True)
class Update:
    batch: TrainBatch  # rows with at least one loss token
    group_of_row: torch.Tensor  # [B'] group index of each kept row (for mini-batch splits)
    advantages_B: torch.Tensor  # [B] of the full rollout (mean over its loss tokens for Reinforce++)
    stats_B: torch.Tensor
    loss_B: torch.Tensor
    low_prob_masked: int  # tokens the low-prob filter removed
    rows_B: torch.Tensor  # [B] bool: the rollout's rows in ``batch``


def build_update(rt: RolloutTensors, old_logprobs_BT: torch.Tensor, *, mode: str, advantage: str | None,
                 overlong: str, low_prob_fraction: float,
                 ref_logprobs_BT: torch.Tensor | None = None) -> Update:
    spec = MODES[mode]
    stats_B, loss_B = row_weights(void_B=rt.void_B, infra_B=rt.infra_B, truncated_B=rt.truncated_B,
                                  drop_void=spec.drop_void, overlong=overlong)
    if advantage is None:  # the critic's GAE fills them in (megatron_tir.train.critic_update)
        adv_BT = torch.zeros_like(rt.loss_mask_BT, dtype=torch.float32)
    else:
        adv_BT = ADVANTAGE_ESTIMATORS[advantage](rt.rewards_B, rt.group_index_B, stats_B, rt.loss_mask_BT)
    adv_B = (adv_BT * rt.loss_mask_BT).sum(1) / rt.loss_mask_BT.sum(1).clamp(min=1)  # per row, for metrics
    mask_BT = rt.loss_mask_BT * loss_B[:, None].float()
    low_prob_masked = 0
    if spec.low_prob_filter:
        keep_BT = low_prob_keep_BT(old_logprobs_BT, mask_BT, low_prob_fraction)
        low_prob_masked = int(((1 - keep_BT) * mask_BT).sum())
        mask_BT = mask_BT * keep_BT
    rows = mask_BT.sum(1) > 0
    extras = {"old_logprobs_BT": old_logprobs_BT[rows], "advantages_BT": adv_BT[rows], "loss_mask_BT": mask_BT[rows],
              "turn_index_BT": rt.turn_index_BT[rows]}
    if ref_logprobs_BT is not None:
        extras["ref_logprobs_BT"] = ref_logprobs_BT[rows]
    batch = TrainBatch(tokens_BT=rt.tokens_BT[rows], attention_mask_BT=rt.attention_mask_BT[rows],
                       loss_mask_BT=mask_BT[rows], extras=extras)
    return Update(batch=batch, group_of_row=rt.group_index_B[rows], advantages_B=adv_B, stats_B=stats_B,
                  loss_B=loss_B, low_prob_masked=low_prob_masked, rows_B=rows)


def with_behaviour_weights(batch: TrainBatch, behaviour_logprobs_BT: torch.Tensor, *, cap: float,
                           mode: str) -> tuple[TrainBatch, dict[str, float]]:
    """``batch`` with the off-policy correction of asynchronous training (:func:`megatron_tir.rl.offpolicy.correction_BT`):
    ``extras["behaviour_weights_BT"]`` against its ``old_logprobs_BT`` (the proximal policy) and, in
    ``mask`` mode, the over-cap tokens out of the loss mask; ``behaviour_logprobs_BT`` are the
    engine's for the batch's rows. Returns the batch and the correction's metrics."""
    w_BT, mask_BT, stats = correction_BT(batch.extras["old_logprobs_BT"], behaviour_logprobs_BT, batch.loss_mask_BT,
                                         cap=cap, mode=mode)
    extras = batch.extras | {"behaviour_weights_BT": w_BT, "loss_mask_BT": mask_BT}
    return TrainBatch(tokens_BT=batch.tokens_BT, attention_mask_BT=batch.attention_mask_BT, loss_mask_BT=mask_BT,
                      extras=extras), stats


def mini_batches(update: Update, n: int) -> list[TrainBatch]:
    """``n`` mini-batches of whole groups, in group order (fewer when there are fewer groups)."""
    groups = torch.unique(update.group_of_row)
    out = []
    for chunk in torch.tensor_split(groups, min(n, len(groups))):
        rows = torch.isin(update.group_of_row, chunk)
        b = update.batch
        out.append(TrainBatch(tokens_BT=b.tokens_BT[rows], attention_mask_BT=b.attention_mask_BT[rows],
                              loss_mask_BT=b.loss_mask_BT[rows], extras={k: v[rows] for k, v in b.extras.items()}))
    return out


@dataclass(kw_only=True, slots=True)
class Collected:
    groups: list[Group]  # at most ``want``, the train batch
    sampled: list[Group]  # everything sampled (for the rollout metrics)
    rounds: int
    removed: dict[str, int]  # groups removed by each filter rule


async def collect_groups(run_round, *, want: int, max_rounds: int, drop_zero_std: bool, accuracy_lo: float,
                         accuracy_hi: float, overlong: str = "keep", min_rows: int = 1, strategy: str = "rounds",
                         seed: int = 0) -> Collected:
    """Dynamic sampling: call ``run_round()`` (an async function returning scored groups) until
    ``want`` groups pass the group filter or ``max_rounds`` rounds are spent. Fewer (even none)
    kept groups is a valid outcome: the caller trains on what there is or skips the update.

    ``strategy="oversample"`` (SimpleTIR's release, ``trainer.oversample_multiplier``): one round;
    ``want`` of the groups that pass are picked at random (``seed``), and a short batch is filled
    by repeating passing groups (each repeat is its own group in the statistics, as there)."""
    kept: list[Group] = []
    sampled: list[Group] = []
    removed = {"no_counted_rows": 0, "zero_std": 0, "accuracy": 0}
    rounds = 0
    if strategy not in SAMPLING_STRATEGIES:
        raise ValueError(f"sampling strategy must be one of {', '.join(SAMPLING_STRATEGIES)}, got {strategy!r}")
    if strategy == "oversample":
        max_rounds = 1
    while len(kept) < want and rounds < max_rounds:
        groups = await run_round()
        rounds += 1
        sampled.extend(groups)
        ok, rem = filter_groups(groups, drop_zero_std=drop_zero_std, accuracy_lo=accuracy_lo,
                                accuracy_hi=accuracy_hi, overlong=overlong, min_rows=min_rows)
        for k, v in rem.items():
            removed[k] += v
        kept.extend(ok)
    if strategy == "oversample" and kept:
        rng = random.Random(seed)
        kept = rng.sample(kept, want) if len(kept) >= want else kept + [rng.choice(kept) for _ in range(want - len(kept))]
    return Collected(groups=kept[:want], sampled=sampled, rounds=rounds, removed=removed)

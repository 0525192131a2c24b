"""From scored groups to what the Learner trains on: group filter, row roles, advantages, masks.

On rank 0 (:class:`~megatron_tir.train.producer.Producer`):

1. :func:`megatron_tir.train.sampling.collect_groups` -- dynamic sampling; the group filter reads
   per-row summaries (reward, status, group: :func:`megatron_tir.rollout.batch.row_summaries`),
   never ``[B, T]`` tensors;
2. :func:`plan_update` -- on the kept groups collated (:func:`megatron_tir.rollout.batch.collate`:
   the tensors and the row summaries in one record), each row's roles
   (:func:`megatron_tir.rl.rows.row_weights`), advantages over *every* counted row (void rows
   included), then only the rows some token of which is trained (:class:`TrainRows`), each
   with its mini-batch; rows no mode trains go no further (no log-probs are computed for them);
3. :func:`deal_rows` -- each data-parallel replica's share of every mini-batch.

On every rank, with its share (what its pipeline stage reads: :func:`stage_fields`):
:func:`build_update` where the loss is computed (old log-probs in, the low-prob token filter,
the ``TrainBatch``), :func:`stage_update` on the other stages, and :func:`mini_batches`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from megatron_tir.policy.learner_contract import TrainBatch
from megatron_tir.rl import ADVANTAGE_ESTIMATORS, MODES, low_prob_keep_BT, needs_values, row_weights
from megatron_tir.rollout.batch import Group, RolloutBatch, RowFate, collate


@dataclass(kw_only=True, slots=True)
class TrainRows:
    """Rows that are trained, with everything a rank needs to train them (row-aligned tensors).

    A pipeline stage reads only part of them (:func:`stage_fields`): the rows a rank receives
    from the hand-off hold ``None`` in the fields its stage does not read."""
    attention_mask_BT: torch.Tensor  # bool; each row's tokens are columns 0 .. length - 1 (right padding)
    mini_batch_B: torch.Tensor  # long: the mini-batch (0..n-1) the row belongs to
    tokens_BT: torch.Tensor | None = None
    loss_mask_BT: torch.Tensor | None = None  # the row roles applied: 1 on the model tokens that get gradient
    engine_logprobs_BT: torch.Tensor | None = None
    advantages_BT: torch.Tensor | None = None  # 0 with a critic (GAE fills them in: megatron_tir.train.critic_update)
    rewards_B: torch.Tensor | None = None  # the rows' outcome rewards (the critic's token rewards)
    turn_index_BT: torch.Tensor | None = None  # long: turn index of each model token, -1 elsewhere
    # int16 [B, T, layers x k]: the engine's MoE routing (rollout.routed_experts), -1 where none; every stage reads it
    routed_experts_BTX: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.attention_mask_BT.shape[0]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The fields this rank holds (None ones left out)."""
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}

    def select(self, index: Sequence[int]) -> TrainRows:
        """The rows ``index`` (in that order), right padding cut to their longest row."""
        idx = torch.as_tensor(list(index), dtype=torch.long)
        attn = self.attention_mask_BT[idx]
        T = int(attn.any(0).nonzero().max()) + 1 if attn.any() else 1
        return TrainRows(**{k: v[idx][:, :T] if v.dim() >= 2 else v[idx] for k, v in self.tensors().items()})

    def stand_in(self, row: int, mini_batch: int) -> TrainRows:
        """Row ``row`` with no loss token, in ``mini_batch``: a replica's share when it has no row (it
        runs so the collectives match, and counts for nothing)."""
        one = self.select([row])
        one.loss_mask_BT = torch.zeros_like(one.loss_mask_BT)
        one.mini_batch_B = torch.tensor([mini_batch])
        return one

    def for_stage(self, *, first: bool, last: bool) -> dict[str, torch.Tensor]:
        """What a pipeline stage receives of these rows (:func:`stage_fields`); a middle stage gets the
        row lengths in place of the attention mask (its micro-batch shapes: ``from_stage`` rebuilds it)."""
        out = {name: getattr(self, name) for name in stage_fields(first=first, last=last)}
        if self.routed_experts_BTX is not None:  # each stage replays its own layers' routing
            out["routed_experts_BTX"] = self.routed_experts_BTX
        if not (first or last):  # its spans are its lengths (right padding): nothing per token travels
            del out["attention_mask_BT"]
            lengths_B = self.attention_mask_BT.sum(1)
            assert torch.equal(self.attention_mask_BT, _right_padded(lengths_B, self.attention_mask_BT.shape[1])), \
                "trained rows are right-padded"
            out["lengths_B"] = lengths_B
        return out

    @staticmethod
    def from_stage(received: dict[str, torch.Tensor], T: int) -> TrainRows:
        """The rows of what ``for_stage`` sent (``T``: the rows' padded length)."""
        received = dict(received)
        if "lengths_B" in received:
            received["attention_mask_BT"] = _right_padded(received.pop("lengths_B"), T)
        return TrainRows(**received)

    @staticmethod
    def cat(parts: Sequence[TrainRows]) -> TrainRows:
        T = max(p.attention_mask_BT.shape[1] for p in parts)

        def pad(name: str, v: torch.Tensor) -> torch.Tensor:
            if v.dim() == 1:
                return v
            pad_T = (0, 0, 0, T - v.shape[1]) if v.dim() == 3 else (0, T - v.shape[1])
            return torch.nn.functional.pad(v, pad_T, value=_PAD.get(name, 0))
        return TrainRows(**{name: torch.cat([pad(name, p.tensors()[name]) for p in parts])
                            for name in parts[0].tensors()})


def stage_fields(*, first: bool, last: bool) -> tuple[str, ...]:
    """The :class:`TrainRows` fields a pipeline stage reads: every stage the rows' spans and
    mini-batches (the micro-batch shapes of the pipeline schedule's sends and receives), the first
    stage the token ids (its embedding; megatron-core's GPTModel reads ``input_ids`` there only),
    the last stage everything its loss reads (token ids as labels, masks, log-probs, advantages,
    rewards, turns); with one stage, all of them."""
    names = ["attention_mask_BT", "mini_batch_B"]
    if first or last:
        names.append("tokens_BT")
    if last:
        names += ["loss_mask_BT", "engine_logprobs_BT", "advantages_BT", "rewards_B", "turn_index_BT"]
    return tuple(names)


def _right_padded(lengths_B: torch.Tensor, T: int) -> torch.Tensor:
    return torch.arange(T).unsqueeze(0) < lengths_B.unsqueeze(1)


_PAD = {"turn_index_BT": -1, "routed_experts_BTX": -1}  # what a padding column holds (0 elsewhere)


@dataclass(kw_only=True, slots=True)
class UpdatePlan:
    """Rank 0's view of one update: the trained rows and what the metrics report of every row."""
    rows: TrainRows
    stats_B: torch.Tensor  # of every collated row: in the advantage statistics
    trained_B: torch.Tensor  # of every collated row: some token of it gets gradient (= rows)
    advantages_B: torch.Tensor  # of every collated row: mean advantage over its model tokens
    versions_BT: torch.Tensor  # of the trained rows: weight version that sampled each loss token (rank 0's metrics)
    estimated: bool  # the advantages are the group estimator's (False: zeros a critic's GAE fills in)


def plan_update(rb: RolloutBatch, *, mode: str, advantage: str | None, overlong: str,
                mini_batches: int, excluded_B: torch.Tensor | None = None) -> UpdatePlan:
    """Row roles and advantages (megatron_tir.rl.rows; ``advantage`` None: zeros, a critic's GAE
    fills them in), then the trained rows in ``mini_batches`` mini-batches of whole groups (fewer
    when there are fewer groups), in group order."""
    s = rb.rows
    stats_B, loss_B = row_weights(void_B=s.void_B, infra_B=s.infra_B, truncated_B=s.truncated_B,
                                  drop_void=MODES[mode].drop_void, overlong=overlong, excluded_B=excluded_B,
                                  data_error_B=s.data_error_B)
    # advantages over every counted row first: void rows shape their group's statistics
    if advantage is None:
        adv_BT = torch.zeros_like(rb.loss_mask_BT, dtype=torch.float32)
    else:
        adv_BT = ADVANTAGE_ESTIMATORS[advantage](s.rewards_B, s.group_index_B, stats_B, rb.loss_mask_BT)
    adv_B = (adv_BT * rb.loss_mask_BT).sum(1) / rb.loss_mask_BT.sum(1).clamp(min=1)
    mask_BT = rb.loss_mask_BT * loss_B[:, None].float()
    trained_B = mask_BT.sum(1) > 0
    groups = s.group_index_B[trained_B]
    mini_batch_B = torch.zeros_like(groups)
    unique = torch.unique(groups)
    for k, chunk in enumerate(torch.tensor_split(unique, min(mini_batches, max(len(unique), 1)))):
        mini_batch_B[torch.isin(groups, chunk)] = k
    rows = TrainRows(tokens_BT=rb.tokens_BT[trained_B], attention_mask_BT=rb.attention_mask_BT[trained_B],
                     loss_mask_BT=mask_BT[trained_B], engine_logprobs_BT=rb.engine_logprobs_BT[trained_B],
                     advantages_BT=adv_BT[trained_B], rewards_B=s.rewards_B[trained_B],
                     turn_index_BT=rb.turn_index_BT[trained_B], mini_batch_B=mini_batch_B,
                     routed_experts_BTX=None if rb.routed_experts_BTX is None else rb.routed_experts_BTX[trained_B])
    return UpdatePlan(rows=rows, stats_B=stats_B, trained_B=trained_B, advantages_B=adv_B,
                      versions_BT=rb.versions_BT[trained_B], estimated=advantage is not None)


def deal_rows(rows: TrainRows, dp_size: int) -> list[TrainRows]:
    """Each data-parallel replica's rows: per mini-batch, longest row first, round robin (the rule
    of ``megatron_tir.policy.microbatch``, so a replica's micro-batches are the ones the Learner
    would have dealt it from the whole batch); a replica left without a row of a mini-batch gets a
    stand-in (:meth:`TrainRows.stand_in`)."""
    lengths = rows.attention_mask_BT.sum(1).tolist()
    shares: list[list[TrainRows]] = [[] for _ in range(dp_size)]
    for k in range(int(rows.mini_batch_B.max()) + 1 if rows.batch_size else 0):
        members = sorted(torch.nonzero(rows.mini_batch_B == k).flatten().tolist(), key=lambda b: (-lengths[b], b))
        for r in range(dp_size):
            mine = sorted(members[r::dp_size])  # in row order: the Learner sorts them the same way again
            shares[r].append(rows.select(mine) if mine else rows.stand_in(members[0], k))
    return [TrainRows.cat(parts) for parts in shares]


@dataclass(kw_only=True, slots=True)
class StepRollouts:
    """One rank's part of a step's rollouts, as the hand-off gives it (:meth:`~megatron_tir.train.handoff.HandOff.take`)."""
    rows: TrainRows | None  # this rank's share of the trained rows; None: no row is trained this step
    mini_batches: int  # mini-batches of the update (the same on every rank)
    metrics: dict[str, float]  # rank 0: rollout and filter metrics; other ranks: {}
    data_position: int  # the prompt stream's position after the step (full: the first position not consumed)
    schedule_switched_at: int | None
    rollout_budget: tuple[int, int]  # (max turns, max response tokens) the step sampled with
    turns: int  # turns of the longest trained row (the per-turn diagnostics' size, the same on every rank)
    sampled: list[Group]  # rank 0: every group the step sampled (the observers'); elsewhere []
    fates: dict[tuple[int, int], RowFate]  # rank 0: what the step decided for each sampled row; elsewhere {}
    data_consumed_ahead: list[int] = dataclasses.field(default_factory=list)  # full: consumed positions past it

    @classmethod
    def of_groups(cls, groups, cfg, *, pad_id: int = 0) -> StepRollouts:
        """A one-replica step of scored ``groups`` (a ``TrainConfig``'s) without a hand-off (what ``take``
        gives a rank when the data-parallel size is 1; for checks of the update alone)."""
        tc = cfg.trainer
        plan = plan_update(collate(groups, pad_id=pad_id), mode=tc.mode,
                           advantage=None if needs_values(tc.ppo.advantage) else tc.ppo.advantage,
                           overlong=tc.filters.overlong, mini_batches=tc.ppo.mini_batches)
        r = plan.rows
        return cls(rows=r if r.batch_size else None, mini_batches=int(r.mini_batch_B.max()) + 1 if r.batch_size else 0,
                   metrics={}, data_position=0, schedule_switched_at=None,
                   rollout_budget=(cfg.rollout.max_turns, cfg.rollout.max_response_tokens),
                   turns=int(r.turn_index_BT.max()) + 1 if r.batch_size else 0, sampled=[], fates={})


@dataclass(kw_only=True, slots=True)
class Update:
    batch: TrainBatch  # this rank's rows
    mini_batch_B: torch.Tensor  # [B'] mini-batch of each row
    low_prob_masked: int  # tokens the low-prob filter removed


def build_update(rows: TrainRows, old_logprobs_BT: torch.Tensor, *, mode: str, low_prob_fraction: float,
                 ref_logprobs_BT: torch.Tensor | None = None) -> Update:
    """The ``TrainBatch`` of ``rows``: ``old_logprobs_BT`` (the learner's recompute, or the engine's)
    and the mode's low-prob token filter."""
    mask_BT = rows.loss_mask_BT
    low_prob_masked = 0
    if MODES[mode].low_prob_filter:
        keep_BT = low_prob_keep_BT(old_logprobs_BT, mask_BT, low_prob_fraction)
        low_prob_masked = int(((1 - keep_BT) * mask_BT).sum())
        mask_BT = mask_BT * keep_BT
    extras = {"old_logprobs_BT": old_logprobs_BT, "advantages_BT": rows.advantages_BT, "loss_mask_BT": mask_BT,
              "turn_index_BT": rows.turn_index_BT}
    if ref_logprobs_BT is not None:
        extras["ref_logprobs_BT"] = ref_logprobs_BT
    batch = TrainBatch(tokens_BT=rows.tokens_BT, attention_mask_BT=rows.attention_mask_BT, loss_mask_BT=mask_BT,
                       extras=extras)
    return Update(batch=batch, mini_batch_B=rows.mini_batch_B, low_prob_masked=low_prob_masked)


def stage_update(rows: TrainRows) -> Update:
    """The update of a pipeline stage that does not compute the loss (its rows hold no loss mask):
    the rows' spans and, on the first stage, their token ids."""
    return Update(batch=TrainBatch(tokens_BT=rows.tokens_BT, attention_mask_BT=rows.attention_mask_BT,
                                   loss_mask_BT=None), mini_batch_B=rows.mini_batch_B, low_prob_masked=0)


def mini_batches(update: Update, n: int) -> list[TrainBatch]:
    """The ``n`` mini-batches of ``update`` (by the rows' ``mini_batch_B``; rows of ones past the last
    group are none: a plan of fewer groups than ``n`` has fewer mini-batches)."""
    out = []
    b = update.batch
    for k in range(n):
        rows = update.mini_batch_B == k
        if not bool(rows.any()):
            break
        out.append(TrainBatch(tokens_BT=None if b.tokens_BT is None else b.tokens_BT[rows],
                              attention_mask_BT=b.attention_mask_BT[rows],
                              loss_mask_BT=None if b.loss_mask_BT is None else b.loss_mask_BT[rows],
                              extras={k: v[rows] for k, v in b.extras.items()}))
    return out

"""Groups of trajectories and their collation into padded tensors for a GRPO-style trainer.

Layout of :class:`RolloutBatch` (B trajectories, T = longest prompt + response):
every ``*_BT`` tensor is aligned with ``tokens_BT``; column ``t`` describes token ``t``.
``loss_mask_BT[b, t]`` is 1 when token ``t`` was sampled by the policy (a model token of
the response), 0 for prompt, feedback and padding; ``engine_logprobs_BT[b, t]`` is the
engine's log-prob of that token where the mask is 1, else 0; ``versions_BT[b, t]`` is the
weight version of the engine that sampled it where the mask is 1, else -1. A trainer that computes
``logp(token t | tokens < t)`` from the logits at ``t - 1`` compares against column ``t``.
Trajectories keep their group order (group-major), ``group_index_B`` says which group
(prompt) each row belongs to. The per-row summaries (reward, group, status: :class:`RowSummaries`)
are built in the same pass, and alone (:func:`row_summaries`) for what reads no ``[B, T]`` tensor
(dynamic sampling's group filter). Which rows a trainer trains is not decided here
(:mod:`megatron_tir.rl.rows`); what the update did with each sampled row comes back as a
:class:`RowFate`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_tir.data.problems import Problem
from megatron_tir.rollout.trajectory import INFRA_STATUSES, FinishStatus, Trajectory


@dataclass(kw_only=True, slots=True)
class Group:
    """The n trajectories sampled for one prompt."""

    group_id: int
    problem: Problem | None
    trajectories: list[Trajectory]

    def __post_init__(self) -> None:
        if not self.trajectories:
            raise ValueError(f"group {self.group_id} has no trajectories")
        bad = [t.group_id for t in self.trajectories if t.group_id != self.group_id]
        if bad:
            raise ValueError(f"group {self.group_id} holds trajectories of group(s) {sorted(set(bad))}")

    @property
    def rewards(self) -> list[float]:
        if any(t.reward is None for t in self.trajectories):
            raise ValueError(f"group {self.group_id} has unscored trajectories")
        return [float(t.reward) for t in self.trajectories]


@dataclass(kw_only=True, slots=True)
class RowSummaries:
    """Per trajectory of a list of groups (group-major): what the group filter and the row roles read."""
    rewards_B: torch.Tensor  # float
    group_index_B: torch.Tensor  # long: position of the row's group in the input (0..G-1)
    void_B: torch.Tensor  # bool
    infra_B: torch.Tensor  # bool: ended by infrastructure (megatron_tir.rollout.trajectory.INFRA_STATUSES)
    truncated_B: torch.Tensor  # bool
    data_error_B: torch.Tensor  # bool: prompt_too_long (the engine refused the prompt: counts nowhere)


@dataclass(kw_only=True, slots=True)
class RolloutBatch:
    tokens_BT: torch.Tensor  # long: prompt + response ids, right-padded with pad_id
    attention_mask_BT: torch.Tensor  # bool: real tokens
    loss_mask_BT: torch.Tensor  # float: 1 on policy-sampled response tokens
    engine_logprobs_BT: torch.Tensor  # float: the engine's (behaviour) log-probs where loss_mask is 1, else 0
    versions_BT: torch.Tensor  # long: weight version that sampled the token where loss_mask is 1, else -1
    turn_index_BT: torch.Tensor  # long: the turn index of each model token, -1 elsewhere (per-turn diagnostics)
    response_start_B: torch.Tensor  # long: index of the first response token (= prompt length)
    lengths_B: torch.Tensor  # long: prompt + response length
    sample_index_B: torch.Tensor  # long
    rows: RowSummaries  # rewards, groups, statuses
    # rollout.routed_experts: int16 [B, T, layers x k] the engine's expert ids of each token (-1: none reported)
    routed_experts_BTX: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.tokens_BT.shape[0]

    @property
    def rewards_B(self) -> torch.Tensor:
        return self.rows.rewards_B

    @property
    def group_index_B(self) -> torch.Tensor:
        return self.rows.group_index_B

    @property
    def void_B(self) -> torch.Tensor:
        return self.rows.void_B


@dataclass(frozen=True, slots=True)
class RowFate:
    """What a step's update did with one sampled trajectory, as the trainer decided it (rank 0's producer:
    its dynamic sampling and its update plan); ``megatron_tir.observe.dumps.update_records`` says why in words."""
    in_stats: bool  # its reward entered its group's statistics
    in_loss: bool  # some model token of it got gradient
    advantage: float | None  # mean over its model tokens; None: its group was not used, or a critic's GAE
    group_rule: str | None = None  # its group was not used: a group-filter rule, "surplus" or "stale"
    row_rule: str | None = None  # the per-row eval filter kept it out of the loss: "verifier_failed" or "repeats"


def flatten(groups: Sequence[Group]) -> list[Trajectory]:
    return [t for g in groups for t in g.trajectories]


def _indexed(groups: Sequence[Group]) -> list[tuple[int, Trajectory]]:
    rows = [(gi, t) for gi, g in enumerate(groups) for t in g.trajectories]
    for _, t in rows:
        if t.reward is None:
            raise ValueError(f"trajectory {t.group_id}/{t.sample_index} has no reward")
    return rows


def _summaries(rows: Sequence[tuple[int, Trajectory]]) -> RowSummaries:
    return RowSummaries(
        rewards_B=torch.tensor([float(t.reward) for _, t in rows], dtype=torch.float32),
        group_index_B=torch.tensor([gi for gi, _ in rows], dtype=torch.long),
        void_B=torch.tensor([t.status is FinishStatus.VOID for _, t in rows], dtype=torch.bool),
        infra_B=torch.tensor([t.status in INFRA_STATUSES for _, t in rows], dtype=torch.bool),
        truncated_B=torch.tensor([t.status is FinishStatus.TRUNCATED for _, t in rows], dtype=torch.bool),
        data_error_B=torch.tensor([t.status is FinishStatus.PROMPT_TOO_LONG for _, t in rows], dtype=torch.bool))


def row_summaries(groups: Sequence[Group]) -> RowSummaries:
    """The per-row summaries of ``groups`` alone (no ``[B, T]`` tensors: dynamic sampling's group filter)."""
    return _summaries(_indexed(groups))


def collate(groups: Sequence[Group], *, pad_id: int, max_len: int | None = None) -> RolloutBatch:
    """Pad every trajectory of ``groups`` (group-major order) into one batch, with its row summaries.

    ``max_len`` (optional) bounds T; a longer trajectory raises ValueError (cut it
    upstream with a smaller response budget instead of silently losing tokens).
    """
    if not groups:
        raise ValueError("collate needs at least one group")
    rows = _indexed(groups)
    for _, t in rows:
        if not (len(t.response_ids) == len(t.loss_mask) == len(t.response_logprobs) == len(t.response_versions)):
            raise ValueError(f"trajectory {t.group_id}/{t.sample_index}: ids, mask, log-probs and versions differ "
                             "in length")
    lengths = [len(t.prompt_ids) + len(t.response_ids) for _, t in rows]
    T = max(lengths)
    if max_len is not None and T > max_len:
        raise ValueError(f"a trajectory has {T} tokens, more than max_len={max_len}")
    B = len(rows)
    tokens = torch.full((B, T), pad_id, dtype=torch.long)
    attn = torch.zeros((B, T), dtype=torch.bool)
    mask = torch.zeros((B, T), dtype=torch.float32)
    old_lp = torch.zeros((B, T), dtype=torch.float32)
    versions = torch.full((B, T), -1, dtype=torch.long)
    turn_index = torch.full((B, T), -1, dtype=torch.long)
    for b, (_, t) in enumerate(rows):
        p, r = len(t.prompt_ids), len(t.response_ids)
        tokens[b, :p + r] = torch.tensor(t.prompt_ids + t.response_ids, dtype=torch.long)
        attn[b, :p + r] = True
        if r:
            m = torch.tensor(t.loss_mask, dtype=torch.float32)
            mask[b, p:p + r] = m
            lp = torch.tensor(t.response_logprobs, dtype=torch.float32)
            old_lp[b, p:p + r] = torch.where(m > 0, lp, torch.zeros_like(lp))
            v = torch.tensor(t.response_versions, dtype=torch.long)
            versions[b, p:p + r] = torch.where(m > 0, v, torch.full_like(v, -1))
        for turn in t.turns:
            turn_index[b, p + turn.start:p + turn.start + turn.model_tokens] = turn.index
    return RolloutBatch(
        tokens_BT=tokens,
        attention_mask_BT=attn,
        loss_mask_BT=mask,
        engine_logprobs_BT=old_lp,
        versions_BT=versions,
        turn_index_BT=turn_index,
        response_start_B=torch.tensor([len(t.prompt_ids) for _, t in rows], dtype=torch.long),
        lengths_B=torch.tensor(lengths, dtype=torch.long),
        sample_index_B=torch.tensor([t.sample_index for _, t in rows], dtype=torch.long),
        rows=_summaries(rows),
        routed_experts_BTX=_routed_experts(rows, T),
    )


def _routed_experts(rows: Sequence[tuple[int, Trajectory]], T: int) -> torch.Tensor | None:
    """The trajectories' engine routing (``Trajectory.routed_experts``) as ``[B, T, layers x k]``, -1 where
    none was reported; None when no trajectory carries any."""
    widths = {t.routed_experts.shape[1] for _, t in rows if t.routed_experts is not None}
    if not widths:
        return None
    if len(widths) > 1:
        raise ValueError(f"trajectories carry routing of different widths {sorted(widths)}")
    out = torch.full((len(rows), T, widths.pop()), -1, dtype=torch.int16)
    for b, (_, t) in enumerate(rows):
        if t.routed_experts is not None:
            out[b, :t.routed_experts.shape[0]] = t.routed_experts.to(torch.int16)
    return out


LAG_BINS = 16  # the staleness histogram's last bin: lags of 16 versions or more


def weight_version_metrics(versions_BT: torch.Tensor, mask_BT: torch.Tensor, *,
                           current: int | None = None) -> dict[str, float]:
    """What the trainer logs about the weight versions of the tokens it trains on (``mask_BT`` > 0).

    With ``current`` (the engine's version now, before this step's sync) also the lag: how
    many syncs ago a token was sampled (0: by the weights being trained; > 0: off-policy), and
    its histogram: ``train/weight_version_lag_share_K`` the share of the trained tokens sampled
    K versions ago, for K = 0 .. the largest lag (the last bin, ``LAG_BINS``, holds every larger lag).
    """
    picked = versions_BT[mask_BT > 0]
    if picked.numel() == 0:
        return {}
    if int(picked.min()) < 0:
        raise ValueError("a trained token has no weight version (-1): no engine sampled it")
    out = {"train/weight_version_min": float(picked.min()), "train/weight_version_max": float(picked.max())}
    if current is not None:
        lag = current - picked
        out |= {"train/weight_version_lag_mean": float(lag.float().mean()),
                "train/weight_version_lag_max": float(lag.max()),
                "train/weight_version_stale_share": float((lag > 0).float().mean())}
        counts = torch.bincount(lag.clamp(min=0, max=LAG_BINS), minlength=int(lag.clamp(max=LAG_BINS).max()) + 1)
        out |= {f"train/weight_version_lag_share_{k}": float(c) / lag.numel() for k, c in enumerate(counts.tolist())}
    return out

"""Which rows count where, and the paper's Table-2 modes -- stated here and nowhere else.

A row (trajectory) plays two roles in an update:

* **statistics** (``stats_B``): its reward enters its group's mean/std (GRPO) or the batch
  whitening (Reinforce++), and the group filter;
* **loss** (``loss_B``): its model tokens get gradient. The token mask the Learner sees is
  ``collate()``'s per-token ``loss_mask_BT`` times ``loss_B`` (times any token filter).

| row                          | statistics | loss                                   |
| ---------------------------- | ---------- | -------------------------------------- |
| completed / max_turns        | yes        | yes                                    |
| void (ended on a void turn)  | yes        | no if the mode drops void rows, else yes |
| tool_failed / aborted        | no         | no (infrastructure, not the model)     |
| truncated (token budget)     | ``"drop"``: no, else yes | ``"mask"`` / ``"drop"``: no; ``"keep"``: yes |
| excluded (``excluded_B``: the per-row eval filter) | yes | no |
| prompt_too_long (``data_error_B``: the engine refused the prompt) | no | no (a data error: no tokens, no reward signal) |

Void rows stay in their group's statistics because SimpleTIR computes advantages over all
sampled trajectories and only then removes void ones from the loss.

Modes (``trainer.mode``), each the rollout's void-turn behaviour plus what the update does:

| mode                 | at a void turn          | void rows in the loss | token filter          |
| -------------------- | ----------------------- | --------------------- | --------------------- |
| naive                | continue (empty feedback) | yes                 | none                  |
| low_prob_filter      | continue                | yes                   | lowest-prob tokens masked |
| high_ratio_filter    | continue                | yes                   | ratio > bound masked  |
| stop_without_filter  | stop                    | yes                   | none                  |
| simpletir (default)  | stop                    | no                    | none                  |
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(kw_only=True, slots=True, frozen=True)
class ModeSpec:
    void_turn: str  # RolloutConfig.void_turn: "stop" | "continue"
    drop_void: bool  # void rows get loss weight 0
    low_prob_filter: bool = False
    high_ratio_filter: bool = False


MODES: dict[str, ModeSpec] = {
    "naive": ModeSpec(void_turn="continue", drop_void=False),
    "low_prob_filter": ModeSpec(void_turn="continue", drop_void=False, low_prob_filter=True),
    "high_ratio_filter": ModeSpec(void_turn="continue", drop_void=False, high_ratio_filter=True),
    "stop_without_filter": ModeSpec(void_turn="stop", drop_void=False),
    "simpletir": ModeSpec(void_turn="stop", drop_void=True),
}
OVERLONG = ("mask", "keep", "drop")  # "drop": SimpleTIR's released ``remove_clip`` (out of the statistics too)


def row_weights(*, void_B: torch.Tensor, infra_B: torch.Tensor, truncated_B: torch.Tensor, drop_void: bool,
                overlong: str, excluded_B: torch.Tensor | None = None,
                data_error_B: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(stats_B, loss_B)`` booleans per the table above. ``infra_B``: tool_failed or aborted;
    ``excluded_B`` (optional): rows a per-row filter keeps out of the loss
    (:func:`megatron_tir.train.row_filter.eval_filter_rules`: a row with a rule); ``data_error_B``
    (optional): prompt_too_long rows, kept out of both (a group of only such rows is ``no_counted_rows``)."""
    if overlong not in OVERLONG:
        raise ValueError(f"overlong must be one of {', '.join(OVERLONG)}, got {overlong!r}")
    void_B, infra_B, truncated_B = void_B.bool(), infra_B.bool(), truncated_B.bool()
    stats_B = ~infra_B
    if overlong == "drop":
        stats_B = stats_B & ~truncated_B
    loss_B = ~infra_B
    if drop_void:
        loss_B = loss_B & ~void_B
    if overlong in ("mask", "drop"):
        loss_B = loss_B & ~truncated_B
    if excluded_B is not None:
        loss_B = loss_B & ~excluded_B.bool()
    if data_error_B is not None:
        stats_B, loss_B = stats_B & ~data_error_B.bool(), loss_B & ~data_error_B.bool()
    return stats_B, loss_B


def low_prob_keep_BT(old_logprobs_BT: torch.Tensor, mask_BT: torch.Tensor, fraction: float) -> torch.Tensor:
    """Per row, 0 on the ``ceil(fraction * n)`` lowest-log-prob tokens among its n mask tokens, else 1."""
    if not 0 <= fraction < 1:
        raise ValueError(f"low_prob_fraction must be in [0, 1), got {fraction}")
    keep_BT = torch.ones_like(mask_BT, dtype=torch.float32)
    for b in range(mask_BT.shape[0]):
        idx = torch.nonzero(mask_BT[b] > 0).flatten()
        k = math.ceil(fraction * idx.numel())
        if k:
            lowest = idx[torch.argsort(old_logprobs_BT[b, idx], stable=True)[:k]]
            keep_BT[b, lowest] = 0.0
    return keep_BT


def group_keep_G(rewards_B: torch.Tensor, group_index_B: torch.Tensor, stats_B: torch.Tensor, *,
                 drop_zero_std: bool, accuracy_lo: float = 0.0, accuracy_hi: float = 1.0,
                 min_rows: int = 1) -> tuple[torch.Tensor, dict[str, int]]:
    """Which groups (0..G-1) the update keeps (dynamic sampling), and how many each rule removed.

    A group is dropped when its counted rewards all agree (zero std: no GRPO signal), when
    its accuracy (mean of reward > 0 over counted rows) lies outside ``[accuracy_lo,
    accuracy_hi]``, or when fewer than ``min_rows`` of its rows count (default: none counts; the
    released SimpleTIR drops groups with fewer than 4 rows left after ``remove_clip``). That last
    rule is counted under ``no_counted_rows``.
    """
    G = int(group_index_B.max()) + 1 if group_index_B.numel() else 0
    keep_G = torch.ones(G, dtype=torch.bool)
    removed = {"no_counted_rows": 0, "zero_std": 0, "accuracy": 0}
    for g in range(G):
        r = rewards_B[(group_index_B == g) & stats_B.bool()].float()
        if r.numel() < max(1, min_rows):
            keep_G[g] = False
            removed["no_counted_rows"] += 1
        elif drop_zero_std and bool((r == r[0]).all()):
            keep_G[g] = False
            removed["zero_std"] += 1
        elif not accuracy_lo <= float((r > 0).float().mean()) <= accuracy_hi:
            keep_G[g] = False
            removed["accuracy"] += 1
    return keep_G, removed

"""The per-row factor of ``trainer.loss.aggregation=microbatch_token_mean`` and
``trainer.loss.denominator=response_tokens`` (:func:`megatron_tir.rl.loss.loss_scale_B`): each
mini-batch's loss tokens, trained rows and response tokens, summed over every data-parallel replica's
rows (the Learner's ``token_mean`` denominator is over them too), then one factor per row.

A row's response tokens are its log-prob columns from its first model token to its last token: the
model's tokens and the tool output between and after them (ZeroTIR's ``response_length``,
``action_mask.sum(-1)``); a row with no loss token counts for nothing.
"""

from __future__ import annotations

import torch

from megatron_tir.rl.loss import SCALE_EXTRA, LossConfig, loss_scale_B


def response_tokens_B(model_mask_BT: torch.Tensor, attention_mask_BT: torch.Tensor) -> torch.Tensor:
    """Per row: log-prob columns from the first model token to the row's last one (right padding), 0 for a
    row without a model token. Column t scores token t + 1, so a row of length L ends at column L - 2."""
    T = model_mask_BT.shape[1]
    on_BT = model_mask_BT > 0
    first_B = torch.where(on_BT, torch.arange(T), T).amin(dim=1)
    last_B = attention_mask_BT.bool().sum(1) - 2
    return torch.where(on_BT.any(1), last_B - first_B + 1, 0).clamp(min=0).float()


def mini_batch_totals(loss_mask_BT: torch.Tensor, model_mask_BT: torch.Tensor, attention_mask_BT: torch.Tensor,
                      mini_batch_B: torch.Tensor, n: int, *, local_rows: bool = False) -> torch.Tensor:
    """``[n, 3]`` float64: loss tokens, trained rows and response tokens of each mini-batch (every
    replica's rows with ``local_rows``; ``n`` the same on every rank)."""
    trained_B = (loss_mask_BT > 0).any(1)
    per_row = torch.stack([loss_mask_BT.float().sum(1), trained_B.float(),
                           response_tokens_B(model_mask_BT, attention_mask_BT) * trained_B], dim=1).double()
    totals = torch.zeros(n, 3, dtype=torch.float64).index_add_(0, mini_batch_B.long(), per_row)
    if local_rows and torch.distributed.is_initialized():
        from megatron.core import parallel_state

        from megatron_tir.policy.parallel import collective_device

        if parallel_state.get_data_parallel_world_size() > 1:
            totals = totals.to(collective_device())
            torch.distributed.all_reduce(totals, group=parallel_state.get_data_parallel_group())
            totals = totals.cpu()
    return totals


def add_loss_scales(update, model_mask_BT: torch.Tensor, cfg: LossConfig, *, mini_batches: int,
                    local_rows: bool = False) -> None:
    """``update.batch.extras[SCALE_EXTRA]``: each row's factor (nothing when the loss takes none).
    ``model_mask_BT``: the rows' model tokens before any token filter (the response's first column)."""
    if not cfg.scaled:
        return
    b = update.batch
    totals = mini_batch_totals(b.loss_mask_BT, model_mask_BT, b.attention_mask_BT, update.mini_batch_B,
                               mini_batches, local_rows=local_rows)
    per_mb = torch.tensor([loss_scale_B(cfg, *map(float, row)) for row in totals], dtype=torch.float32)
    b.extras[SCALE_EXTRA] = per_mb[update.mini_batch_B.long()]

"""Rows of a mini-batch -> this data-parallel rank's micro-batches, binned by a token budget.

Each row's tokens are one contiguous span of its ``attention_mask_BT`` (padding on either
side). Rows are dealt to the data-parallel ranks longest first, round robin (balanced
token counts), then each rank bins its rows, longest first, into micro-batches whose
padded size ``rows x longest row`` stays within ``max_tokens`` (a row longer than the
budget gets a micro-batch of its own). Lengths are rounded up to a multiple of ``pad_to``
(sequence parallelism splits a micro-batch's sequence over the TP ranks; FP8 GEMMs want
multiples of 16), and the rounded length is what counts against the budget and as padding.
A micro-batch holds its rows right-padded to its
longest span, so column ``j`` of a micro-batch row is column ``start + j`` of the
mini-batch row; ``pack``/``unpack`` move ``[B, T]`` tensors between the two layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(kw_only=True, slots=True)
class MicroBatch:
    """Rows (mini-batch indices) with their spans ``(start, end)``; ``weight`` 0 marks a stand-in
    micro-batch of a rank that got no rows (it runs so the collectives match, and counts for nothing)."""

    rows: list[int]
    spans: list[tuple[int, int]]
    weight: float = 1.0
    pad_to: int = 1  # the length is a multiple of this

    @property
    def length(self) -> int:
        return _round_up(max(end - start for start, end in self.spans), self.pad_to)

    @property
    def real_tokens(self) -> int:
        return sum(end - start for start, end in self.spans)

    @property
    def padded_tokens(self) -> int:
        return len(self.rows) * self.length

    def pack(self, values_BT: torch.Tensor, fill=0) -> torch.Tensor:
        """``[B, T]`` (or ``[B]``) mini-batch tensor -> this micro-batch's ``[b, L]`` (or ``[b]``)."""
        if values_BT.dim() == 1:
            return values_BT[self.rows]
        out = values_BT.new_full((len(self.rows), self.length), fill)
        for i, (row, (start, end)) in enumerate(zip(self.rows, self.spans)):
            out[i, :end - start] = values_BT[row, start:end]
        return out

    def unpack(self, values_bL: torch.Tensor, out_BT: torch.Tensor) -> None:
        """Write a ``[b, L]`` micro-batch tensor back into the rows and columns it came from."""
        for i, (row, (start, end)) in enumerate(zip(self.rows, self.spans)):
            out_BT[row, start:end] = values_bL[i, :end - start]

    def mask(self) -> torch.Tensor:
        """``[b, L]`` bool: True on each row's tokens."""
        lengths = torch.tensor([end - start for start, end in self.spans])
        return torch.arange(self.length).unsqueeze(0) < lengths.unsqueeze(1)


def row_spans(attention_mask_BT: torch.Tensor) -> list[tuple[int, int] | None]:
    """Each row's ``(start, end)`` token span, None for an empty row; ValueError if a row's tokens
    are not contiguous."""
    mask = attention_mask_BT.bool()
    spans: list[tuple[int, int] | None] = []
    for b, row in enumerate(mask):
        idx = row.nonzero().flatten()
        if idx.numel() == 0:
            spans.append(None)
            continue
        start, end = int(idx[0]), int(idx[-1]) + 1
        if end - start != idx.numel():
            raise ValueError(f"row {b} of attention_mask_BT is not one contiguous span of tokens")
        spans.append((start, end))
    return spans


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def plan_microbatches(attention_mask_BT: torch.Tensor, *, max_tokens: int, dp_rank: int = 0,
                      dp_size: int = 1, pad_to: int = 1) -> list[MicroBatch]:
    """This data-parallel rank's micro-batches (see the module docstring); never empty."""
    if pad_to < 1:
        raise ValueError(f"pad_to must be >= 1, got {pad_to}")
    spans = row_spans(attention_mask_BT)
    rows = sorted((b for b, s in enumerate(spans) if s is not None), key=lambda b: (-(spans[b][1] - spans[b][0]), b))
    if not rows:
        raise ValueError("the batch has no tokens (attention_mask_BT is all zero)")
    mine = rows[dp_rank::dp_size]
    if not mine:  # fewer rows than data-parallel ranks: a stand-in that counts for nothing
        return [MicroBatch(rows=[rows[0]], spans=[spans[rows[0]]], weight=0.0, pad_to=pad_to)]
    out: list[MicroBatch] = []
    current: list[int] = []
    for b in mine:  # longest first: the first row of a micro-batch sets its length
        first = current[0] if current else b
        longest = _round_up(spans[first][1] - spans[first][0], pad_to)
        if current and (len(current) + 1) * longest > max_tokens:
            out.append(MicroBatch(rows=current, spans=[spans[r] for r in current], pad_to=pad_to))
            current = []
        current.append(b)
    out.append(MicroBatch(rows=current, spans=[spans[r] for r in current], pad_to=pad_to))
    return out


def padding_share(micro_batches: list[MicroBatch]) -> float:
    """Share of the micro-batches' token slots that are padding."""
    padded = sum(mb.padded_tokens for mb in micro_batches)
    return 1.0 - sum(mb.real_tokens for mb in micro_batches) / padded if padded else 0.0

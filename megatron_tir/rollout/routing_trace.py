"""The engine's MoE routing of one trajectory, position by position (``rollout.routed_experts``).

A trajectory's turns are requests whose prompt is everything so far; an engine that reports
routed experts (``EngineKind.routed_experts``: SGLang's ``return_routed_experts``) returns those of
positions ``s ..`` the request's last forwarded token, where ``s`` is the first position the
trajectory has none for yet (``routed_experts_from``): the previous answer's last sampled token and
the tool feedback after it arrive with the next request, nothing is sent twice. A turn whose
tail the driver discards (the overshoot past a code fence) drops those positions' routing too.

``rows()`` is ``[n, layers x k]`` int16 for positions ``0 .. n - 1`` (``n`` is at most the
trajectory's tokens less one: its last token was never forwarded); the learner replays it
(``policy.routing.UpdateRouting``, positions without a record route freely). Size: ``2 x layers x
k`` bytes a token (Qwen3-30B-A3B: 768 B; a step of 8,192 trajectories of 5,000 tokens holds 31 GB
on the rank that collects them, the price of rollout replay).
"""

from __future__ import annotations

import torch


class RoutingTrace:
    """Routed experts per position, as a trajectory's requests return them."""

    def __init__(self) -> None:
        self._parts: list[torch.Tensor] = []
        self.covered = 0  # positions 0 .. covered - 1 have their routing

    def add(self, routed: torch.Tensor | None, *, start: int) -> None:
        """An answer's routed experts of positions ``start ..`` (None: the request was aborted first)."""
        if routed is None or routed.shape[0] == 0:
            return
        if start != self.covered:
            raise ValueError(f"routing of positions from {start} does not continue the trace at {self.covered}")
        if self._parts and routed.shape[1] != self._parts[0].shape[1]:
            raise ValueError(f"routing rows of {routed.shape[1]} ids after rows of {self._parts[0].shape[1]}")
        self._parts.append(routed.to(torch.int16))
        self.covered += routed.shape[0]

    def truncate(self, n_tokens: int) -> None:
        """The sequence was cut to ``n_tokens`` tokens: routing of positions past them is dropped."""
        if n_tokens >= self.covered:
            return
        rows = self.rows()[:n_tokens]
        self._parts, self.covered = ([rows] if n_tokens else []), n_tokens

    def rows(self) -> torch.Tensor | None:
        if not self._parts:
            return None
        if len(self._parts) > 1:
            self._parts = [torch.cat(self._parts)]
        return self._parts[0]

"""The local engine's prefix cache: K/V of finished requests, reused by requests that start with
the same tokens (what SGLang's radix cache does for a server, on by default there).

A multi-turn rollout sends every turn as a new request over the whole context so far (prompt,
earlier turns, tool feedback), and a turn that stops inside its markup continues with another
request over context + the turn's tokens. Without reuse every such request prefills its whole
context again: on ``smollm2-cpu`` (8 prompts x 4 samples, <= 3 turns) one step's rollouts
prefilled 20,729 tokens for 4,756 sampled, and prefill was 52% of the engine's time.

:class:`PrefixCache` keeps, for each finished request, the K/V of the tokens its row had cached
(prompt + output minus the pending last token), least recently used first out, within a budget
of ``max_tokens``. :meth:`PrefixCache.match` finds the entry sharing the longest common prefix
with a new context (any prefix of an entry's tokens is valid K/V for a context that starts with
those tokens: causal attention). Entries are only ever computed under the engine's current
weights: the engine clears the cache on every weight update and stores a row only if its whole
K/V was computed under the weights in use (a row that continued across an update is not stored).

The matched K/V are bit-for-bit what a prefill of those tokens produced then; a prefill of the
whole context now could differ from them in the last float bits (products over other row
counts), as batched and unbatched steps already do (engines.local, "up to float rounding").
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch


@dataclass(slots=True, eq=False)
class CachedPrefix:
    tokens: list[int]
    keys: torch.Tensor  # [layers, kv_heads, len(tokens), head_dim]
    values: torch.Tensor


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b`` (slice comparisons run in C)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixCache:
    """LRU store of finished rows' K/V within ``max_tokens`` tokens (worker-thread state)."""

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self.entries: collections.OrderedDict[int, CachedPrefix] = collections.OrderedDict()  # oldest first
        self.tokens = 0
        self._next_id = 0
        # what it saved: prefill tokens taken from the cache, and those computed (any request)
        self.hits = 0
        self.reused_tokens = 0
        self.prefilled_tokens = 0

    def __len__(self) -> int:
        return len(self.entries)

    def match(self, context: list[int]) -> tuple[CachedPrefix | None, int]:
        """The entry sharing the longest prefix with ``context`` and that length (at most
        ``len(context) - 1``: the last token is always computed, its logits are the request's first)."""
        best, best_n, best_key = None, 0, None
        limit = len(context) - 1
        for key, entry in self.entries.items():
            if not entry.tokens or entry.tokens[0] != context[0]:
                continue
            n = min(common_prefix(entry.tokens, context), limit)
            if n > best_n:
                best, best_n, best_key = entry, n, key
        if best_key is not None:
            self.entries.move_to_end(best_key)
        return best, best_n

    def insert(self, tokens: list[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keep ``tokens``' K/V; entries that are a prefix of ``tokens`` go (this one covers them),
        then the least recently used until the budget holds. An entry over the budget is not kept."""
        if not tokens or len(tokens) > self.max_tokens:
            return
        for key in [k for k, e in self.entries.items()
                    if len(e.tokens) <= len(tokens) and tokens[:len(e.tokens)] == e.tokens]:
            self._drop(key)
        self.entries[self._next_id] = CachedPrefix(tokens=list(tokens), keys=keys, values=values)
        self._next_id += 1
        self.tokens += len(tokens)
        while self.tokens > self.max_tokens:
            self._drop(next(iter(self.entries)))

    def clear(self) -> None:
        self.entries.clear()
        self.tokens = 0

    def _drop(self, key: int) -> None:
        self.tokens -= len(self.entries.pop(key).tokens)

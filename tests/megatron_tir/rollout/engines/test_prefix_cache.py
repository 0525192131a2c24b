"""The local engine's prefix store: longest common prefix, LRU eviction within a token budget."""

from __future__ import annotations

import random

import pytest
import torch
from megatron_tir.rollout.engines.prefix_cache import PrefixCache, common_prefix


def brute_common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_common_prefix_equals_a_token_by_token_scan():
    rng = random.Random(0)
    for _ in range(500):
        a = [rng.randrange(3) for _ in range(rng.randrange(0, 40))]
        b = a[:rng.randrange(0, len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(0, 10))]
        assert common_prefix(a, b) == common_prefix(b, a) == brute_common_prefix(a, b)


def kv(n):
    return torch.full((2, 1, n, 4), float(n)), torch.zeros(2, 1, n, 4)


def test_match_takes_the_longest_shared_prefix_but_leaves_the_last_token_to_compute():
    cache = PrefixCache(100)
    cache.insert([1, 2, 3, 4], *kv(4))
    cache.insert([1, 2, 9], *kv(3))
    entry, n = cache.match([1, 2, 3, 4, 5, 6])
    assert entry.tokens == [1, 2, 3, 4] and n == 4
    entry, n = cache.match([1, 2, 3, 4])  # the whole context is cached: its last token is still computed
    assert entry.tokens == [1, 2, 3, 4] and n == 3
    entry, n = cache.match([1, 2, 9, 9])
    assert entry.tokens == [1, 2, 9] and n == 3
    assert cache.match([7, 1, 2]) == (None, 0)


def test_budget_evicts_least_recently_used_and_a_longer_row_replaces_its_prefixes():
    cache = PrefixCache(10)
    cache.insert([1, 2, 3], *kv(3))
    cache.insert([4, 5, 6], *kv(3))
    cache.insert([1, 2, 3, 7], *kv(4))  # covers [1, 2, 3]: that entry goes
    assert sorted(e.tokens[0] for e in cache.entries.values()) == [1, 4] and cache.tokens == 7
    cache.match([4, 5, 6, 0])  # [4, 5, 6] is now the most recently used
    cache.insert([8, 8, 8], *kv(3))  # 10 tokens: fits
    cache.insert([9, 9], *kv(2))  # 12 > 10: the least recently used ([1, 2, 3, 7]) goes
    assert [e.tokens for e in cache.entries.values()] == [[4, 5, 6], [8, 8, 8], [9, 9]] and cache.tokens == 8
    cache.insert(list(range(11)), *kv(11))  # larger than the whole budget: not kept
    assert cache.tokens == 8
    cache.clear()
    assert len(cache) == 0 and cache.tokens == 0 and cache.match([4, 5, 6, 0]) == (None, 0)
    with pytest.raises(ValueError, match="max_tokens"):
        PrefixCache(-1)

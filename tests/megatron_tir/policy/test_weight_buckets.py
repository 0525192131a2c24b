"""The one bucket rule of the weight exports and ``bucket_layout`` (``policy.weights._bucketed``),
by hand: a bucket closes once it holds ``bucket_bytes``, one item may overshoot, the rest is the last."""

from __future__ import annotations

import math

from megatron_tir.launch.model_facts import model_spec
from megatron_tir.policy.weights import _bucketed, bucket_layout, stage_plans


def test_the_rule_by_hand():
    items = [("a", 3), ("b", 3), ("c", 3), ("d", 1), ("e", 9), ("f", 1)]
    got = [[n for n, _ in b] for b in _bucketed(items, lambda n: n, 5)]
    assert got == [["a", "b"], ["c", "d", "e"], ["f"]]
    assert [[n for n, _ in b] for b in _bucketed(items, lambda n: n, 1)] == [[n] for n, _ in items]
    assert list(_bucketed([], lambda n: n, 5)) == []


def test_the_layout_cuts_each_stage_by_the_rule():
    spec = model_spec("Qwen2.5-7B")
    layout = bucket_layout(spec, 2, 256 << 20, 2)
    for stage, buckets in enumerate(layout):
        names = [n for p in stage_plans(spec, stage, 2) for n in p.hf]
        assert [n for b in buckets for n, _ in b] == names  # every tensor once, in order
        sizes = [[2 * int(math.prod(s)) for _, s in b] for b in buckets]
        assert all(sum(b) >= 256 << 20 and sum(b) - b[-1] < 256 << 20 for b in sizes[:-1])  # closed once full
        assert sum(sizes[-1]) - sizes[-1][-1] < 256 << 20

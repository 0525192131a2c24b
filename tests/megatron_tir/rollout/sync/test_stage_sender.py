"""The per-stage sender (``StageSender.send``) alone, in a one-rank gloo group: how many buckets it
keeps alive while it sends, and its check of each bucket against the layout rank 0 announced."""

from __future__ import annotations

import time
import weakref

import pytest
import torch
import torch.distributed as dist

from megatron_tir.rollout.sync.stages import StageSender


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class Sent:
    """What a finished collective's ``Work`` answers to ``wait()``."""

    def wait(self) -> bool:
        return True


def slow_wire(monkeypatch, seconds: float, *, real: bool = True) -> list:
    """``seconds`` on the wire, then the real (gloo) broadcast, or none (``real=False``): what each
    call sent, in order. Without it: a one-rank broadcast moves no bytes, and gloo's own ``Work``
    is dropped by its worker thread a moment after ``wait()`` returns (a C++ reference the sender
    cannot release; counted, it made the two-bucket test fail in a loaded CI run)."""
    gloo, sent = dist.broadcast, []

    def broadcast(tensor, *args, **kwargs):
        time.sleep(seconds)
        sent.append(tensor.numel())
        return gloo(tensor, *args, **kwargs) if real else Sent()

    monkeypatch.setattr(dist, "broadcast", broadcast)
    return sent


def test_at_most_two_buckets_are_alive_while_the_sender_sends(one_rank_group, monkeypatch):
    slow_wire(monkeypatch, 0.02, real=False)  # the sender's own references are what the bound holds
    alive: list[list[weakref.ref]] = []  # per bucket built: its tensors
    most = []

    def builder(n: int):
        for i in range(n):
            most.append(sum(any(r() is not None for r in refs) for refs in alive))  # before building bucket i
            tensors = [(f"w{i}", torch.full((256,), float(i)))]  # contiguous: sent as they are (not flattened)
            alive.append([weakref.ref(t) for _, t in tensors])
            yield 0, tensors

    sender = StageSender(backend="gloo", timeout_s=30)
    sender.send(builder(8), flattened=False)
    assert [names for _, names, _ in sender.sent] == [[f"w{i}"] for i in range(8)]
    # the bucket on the wire and the one built next: never a third (the old one-slot queue held three)
    assert max(most) <= 1, most


def test_flattened_buckets_reuse_two_buffers_and_each_goes_out_intact(one_rank_group, monkeypatch):
    """On the CPU the sender flattens into two buffers kept between buckets and syncs, alternating:
    bucket i's buffer is written again only once bucket i's bytes have gone (a copy of each broadcast
    tensor, taken on the wire, equals SGLang's layout of that bucket), and a second sync reuses them."""
    from megatron_tir.rollout.sync.base import flatten

    gloo, wire = dist.broadcast, []

    def broadcast(tensor, *args, **kwargs):
        time.sleep(0.01)  # the builder runs ahead meanwhile
        wire.append((tensor.data_ptr(), tensor.clone()))
        return gloo(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "broadcast", broadcast)

    def buckets(seed: int) -> list:  # each no larger than the one two before it: no buffer grows
        g = torch.Generator().manual_seed(seed)
        return [[(f"w{i}", torch.randn(60 - i, generator=g)), (f"b{i}", torch.randn(8, generator=g))] for i in range(5)]

    sender = StageSender(backend="gloo", timeout_s=30)
    for seed in (0, 1):
        wire.clear()
        expected = buckets(seed)
        sender.send(((0, b) for b in buckets(seed)), flattened=True)
        assert len(wire) == 5
        for (_, got), bucket in zip(wire, expected):
            assert torch.equal(got, flatten(bucket))
        rings = [b.data_ptr() for b in sender.staging]
        assert [ptr for ptr, _ in wire] == [rings[i % 2] for i in range(5)]  # two buffers, alternating
        if seed == 0:
            first = rings
    assert rings == first  # kept between syncs


def test_a_bucket_that_drifted_from_the_announced_layout_is_refused(one_rank_group, monkeypatch):
    sent = slow_wire(monkeypatch, 0)
    announced = [[("a", (2, 3)), ("b", (4,))], [("c", (5,))]]

    def buckets(c_shape):
        yield 1, [("a", torch.zeros(2, 3)), ("b", torch.zeros(4))]
        yield 1, [("c", torch.zeros(c_shape))]

    sender = StageSender(backend="gloo", timeout_s=30)
    sender.send(buckets((5,)), flattened=True, stage=1, layout=announced, dtype="float32")  # as announced
    assert len(sent) == 2
    sent.clear()
    with pytest.raises(ValueError, match=r"stage 1 bucket 1: c has shape \(6,\), announced \(5,\)"):
        sender.send(buckets((6,)), flattened=True, stage=1, layout=announced, dtype="float32")
    assert len(sent) == 1  # the drifted bucket never went out
    with pytest.raises(ValueError, match="stage 1 bucket 0: a has dtype float32, announced bfloat16"):
        sender.send(buckets((5,)), flattened=True, stage=1, layout=announced, dtype="bfloat16")
    with pytest.raises(ValueError, match="stage 1 bucket 0: b where d was announced"):
        sender.send(buckets((5,)), flattened=True, stage=1, layout=[[("a", (2, 3)), ("d", (4,))], [("c", (5,))]],
                    dtype="float32")
    with pytest.raises(ValueError, match="stage 1 bucket 1: c was not announced"):
        sender.send(buckets((5,)), flattened=True, stage=1, layout=announced[:1], dtype="float32")
    with pytest.raises(ValueError, match="stage 1: 2 buckets built, 3 announced"):
        sender.send(buckets((5,)), flattened=True, stage=1, layout=[*announced, [("e", (1,))]], dtype="float32")

"""The flattened-bucket layout against SGLang 0.5.23's own ``FlattenedTensorBucket``
(``srt/weight_sync/tensor_bucket.py``, loaded alone from the installed source): what the trainer
broadcasts is what the server's ``FlattenedTensorBucket.empty`` + ``reconstruct_tensors`` reads."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from megatron_tir.rollout.sync.base import flatten
from megatron_tir.rollout.sync.stages import round_robin


def sglang_bucket_module():
    root = importlib.util.find_spec("sglang").submodule_search_locations[0]
    spec = importlib.util.spec_from_file_location("sglang_tensor_bucket_test", f"{root}/srt/weight_sync/tensor_bucket.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_flatten_is_sglangs_layout_and_the_receiver_reads_it_back():
    tb = sglang_bucket_module()
    g = torch.Generator().manual_seed(0)
    tensors = [("a", torch.randn(3, 5, generator=g)), ("b", torch.randn(8, generator=g).to(torch.bfloat16)),
               ("c", torch.randn(2, 2, generator=g).t())]  # a non-contiguous one
    flat = flatten(tensors)
    assert flat.dtype == torch.uint8
    assert torch.equal(flat, tb.FlattenedTensorBucket(named_tensors=tensors).get_flattened_tensor())
    received = tb.FlattenedTensorBucket.empty([n for n, _ in tensors], [str(t.dtype).removeprefix("torch.")
                                                                        for _, t in tensors],
                                              [list(t.shape) for _, t in tensors], "cpu")
    received.get_flattened_tensor().copy_(flat)  # what the broadcast does
    for (name, want), (got_name, got) in zip(tensors, received.reconstruct_tensors()):
        assert name == got_name and got.dtype == want.dtype and torch.equal(got, want)


def test_a_tensor_the_receiver_could_not_align_is_refused():
    tensors = [("b", torch.zeros(3, dtype=torch.bfloat16)), ("a", torch.zeros(2))]  # a would start at byte 6
    with pytest.raises(ValueError, match="a .*byte 6"):
        flatten(tensors)


def test_the_stages_take_turns_one_bucket_each():
    layout = [[["s0b0"], ["s0b1"], ["s0b2"]], [["s1b0"]]]
    assert [b[0] for _, b in round_robin(layout)] == ["s0b0", "s1b0", "s0b1", "s0b2"]
    assert [s for s, _ in round_robin(layout)] == [0, 1, 0, 0]


@pytest.mark.parametrize("bad,message", [({"bucket_bytes": 0}, "bucket_bytes"), ({"load_format": "direct"}, "load_format"),
                                         ({"backend": "mpi"}, "backend"), ({"pause_mode": "in_place"}, "pause_mode"),
                                         ({"coordination_timeout_s": 0}, "coordination_timeout_s")])
def test_the_per_stage_sync_config_refuses_what_it_cannot_do(bad, message):
    from megatron_tir.rollout.sync.stages import StageWeightSyncConfig

    with pytest.raises(ValueError, match=message):
        StageWeightSyncConfig(**bad)


def test_flatten_into_a_kept_buffer_writes_its_first_bytes():
    g = torch.Generator().manual_seed(1)
    tensors = [("a", torch.randn(3, 5, generator=g)), ("b", torch.randn(4, generator=g).to(torch.bfloat16))]
    want = flatten(tensors)
    out = torch.full((want.numel() + 7,), 255, dtype=torch.uint8)
    got = flatten(tensors, out=out)
    assert torch.equal(got, want) and got.data_ptr() == out.data_ptr()
    assert torch.equal(out[want.numel():], torch.full((7,), 255, dtype=torch.uint8))  # the rest untouched
    lone = torch.randn(6, generator=g)
    assert flatten([("c", lone)], out=out).data_ptr() == lone.data_ptr()  # a lone tensor goes as it is
    with pytest.raises(ValueError, match=f"at least {want.numel()} bytes"):
        flatten(tensors, out=out[: want.numel() - 1])

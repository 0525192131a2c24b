"""The streaming safetensors writer produces files safetensors/transformers read back exactly."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from megatron_tir.policy.checkpoint.hf_io import INDEX_NAME, HFReader, StreamingSafetensorsWriter, TensorEntry


def _tensors():
    torch.manual_seed(0)
    return {"a.weight": torch.randn(3, 5), "b.bias": torch.randn(7).bfloat16(), "c": torch.randn(2, 2, 2).half()}


def test_single_file_round_trip(tmp_path):
    tensors = _tensors()
    entries = [TensorEntry(name=n, shape=tuple(t.shape), dtype=t.dtype) for n, t in tensors.items()]
    with StreamingSafetensorsWriter(tmp_path, entries) as w:
        for n, t in tensors.items():
            w.write(n, t)
    back = load_file(tmp_path / "model.safetensors")
    assert set(back) == set(tensors) and all(torch.equal(back[n], t) for n, t in tensors.items())
    reader = HFReader(tmp_path)
    assert torch.equal(reader.get("b.bias"), tensors["b.bias"])


def test_sharded_files_with_index(tmp_path):
    tensors = _tensors()
    entries = [TensorEntry(name=n, shape=tuple(t.shape), dtype=t.dtype) for n, t in tensors.items()]
    with StreamingSafetensorsWriter(tmp_path, entries, max_shard_bytes=20) as w:
        for n, t in tensors.items():
            w.write(n, t)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert len(set(index["weight_map"].values())) == 3
    reader = HFReader(tmp_path)
    assert all(torch.equal(reader.get(n), t) for n, t in tensors.items())


def test_writer_refuses_wrong_order_and_missing_tensors(tmp_path):
    tensors = _tensors()
    entries = [TensorEntry(name=n, shape=tuple(t.shape), dtype=t.dtype) for n, t in tensors.items()]
    with pytest.raises(AssertionError):
        with StreamingSafetensorsWriter(tmp_path, entries) as w:
            w.write("b.bias", tensors["b.bias"])
    with pytest.raises(AssertionError, match="only 1 of 3"):
        with StreamingSafetensorsWriter(tmp_path, entries) as w:
            w.write("a.weight", tensors["a.weight"])


def test_reader_views_files_in_place_and_release_keeps_tensors_valid(tmp_path):
    from safetensors.torch import save_file

    tensors = {"big": torch.randn(512, 1024), "small": torch.randn(3)}
    save_file(tensors, tmp_path / "model.safetensors")
    reader = HFReader(tmp_path)
    assert reader.shape("big") == (512, 1024) and reader.dtype_name("small") == "F32"
    big = reader.get("big")
    assert big.untyped_storage().nbytes() == big.nbytes  # a view of exactly its bytes (what torch.save writes)
    reader.release()  # its pages leave this process; the tensor reads them again
    assert torch.equal(big, tensors["big"]) and torch.equal(reader.get("small"), tensors["small"])


def test_truncated_or_corrupt_files_are_one_clear_error(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.randn(64, 64)}, tmp_path / "model.safetensors")
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(ValueError, match="bad byte range .* truncated"):
        HFReader(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    with pytest.raises(ValueError, match="corrupt safetensors header"):
        HFReader(tmp_path)


def test_copying_stream_writes_mapped_bytes_from_their_file(tmp_path):
    # What the torch_dist writer does with tensors that view an HFReader mapping: the same
    # bytes land in the output, copied by the kernel from the source file.
    from safetensors.torch import save_file

    from megatron_tir.policy.checkpoint.dist_writer import _CopyingStream

    src = {"w": torch.randn(256, 256), "b": torch.randn(4)}
    save_file(src, tmp_path / "model.safetensors")
    reader = HFReader(tmp_path)
    w = reader.get("w")
    sources = reader.copy_sources()
    stream = _CopyingStream(tmp_path / "out.bin", "wb", sources)
    stream.write(b"head")
    stream.write(memoryview(w.numpy()).cast("B"))  # 256 KiB inside the mapping: copied
    stream.write(memoryview(torch.ones(64 * 1024).numpy()).cast("B"))  # big, not mapped: written
    assert stream.tell() == 4 + w.nbytes + 4 * 64 * 1024
    stream.close()
    reader.close()
    data = (tmp_path / "out.bin").read_bytes()
    assert data == b"head" + w.numpy().tobytes() + torch.ones(64 * 1024).numpy().tobytes()
    assert stream.copied == w.nbytes

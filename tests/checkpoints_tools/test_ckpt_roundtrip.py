"""HF -> Megatron -> HF is bit-exact for every tensor, and the layout docs hold."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from checkpoints_tools.convert import megatron_to_hf
from megatron_tir.policy.checkpoint.layout import POLICY, read_meta, resolve_checkpoint


def _assert_same_tensors(src_dir, out_dir, tied: bool):
    a = load_file(src_dir / "model.safetensors")
    if tied:
        a.pop("lm_head.weight", None)
    b = load_file(out_dir / "model.safetensors")
    assert set(a) == set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("family,tied", [("llama", True), ("llama", False), ("qwen2", True), ("qwen2", False),
                                         ("qwen3", True), ("qwen3", False), ("qwen3_moe", False)])
def test_tiny_round_trip_is_bit_exact(family, tied, make_tiny_hf, convert_once, tmp_path):
    hf_dir = make_tiny_hf(family, tie_word_embeddings=tied)
    ckpt = convert_once(hf_dir)
    meta = read_meta(ckpt)
    assert meta.spec.family == family and meta.spec.tie_word_embeddings == tied
    assert meta.spec.qkv_bias == (family == "qwen2") and meta.spec.qk_layernorm == family.startswith("qwen3")
    assert meta.spec.num_experts == (8 if family == "qwen3_moe" else 0)
    out = megatron_to_hf(ckpt, tmp_path / "hf")
    _assert_same_tensors(hf_dir, out, tied)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == family and config["tie_word_embeddings"] == tied
    assert (out / "tokenizer.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_bf16_round_trip_keeps_dtype_and_bits(tmp_path):
    from transformers import AutoModelForCausalLM

    from checkpoints_tools.convert import hf_to_megatron
    from tiny_models import tiny_config

    torch.manual_seed(1)
    src = tmp_path / "bf16"
    AutoModelForCausalLM.from_config(tiny_config("qwen2", tie_word_embeddings=False, vocab_size=512)).to(
        torch.bfloat16).save_pretrained(src)
    ckpt = hf_to_megatron(src, tmp_path / "ckpt")
    assert read_meta(ckpt).spec.dtype == "bfloat16"
    out = megatron_to_hf(ckpt, tmp_path / "hf")
    _assert_same_tensors(src, out, tied=False)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_smollm2_round_trip_is_bit_exact(smollm2_dir, smollm2_ckpt, tmp_path):
    out = megatron_to_hf(smollm2_ckpt, tmp_path / "hf")
    _assert_same_tensors(smollm2_dir, out, tied=True)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config  # the exported weights are plain float tensors


def test_exported_dir_loads_in_transformers_with_identical_logits(make_tiny_hf, convert_once, tmp_path):
    from transformers import AutoModelForCausalLM

    hf_dir = make_tiny_hf("qwen2", tie_word_embeddings=False)
    out = megatron_to_hf(convert_once(hf_dir), tmp_path / "hf")
    ids = torch.tensor([[1, 5, 9, 300, 7, 2]])
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(hf_dir).eval()(ids).logits
        got = AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
    assert torch.equal(ref, got)


def test_sharded_export_and_run_dir_resolution(make_tiny_hf, convert_once, tmp_path):
    """A run dir (as RunCheckpoints writes it) resolves to the policy of the step ``latest`` names,
    a step dir to its policy; the export splits into shards."""
    from megatron_tir.train.checkpoint import RunCheckpoints, TrainerState

    hf_dir = make_tiny_hf("llama", tie_word_embeddings=False)
    ckpt = convert_once(hf_dir)
    run = tmp_path / "run"
    ck = RunCheckpoints(run, keep_last=2, save_learner=lambda learner, d: shutil.copytree(learner, d),
                        load_learner=None)
    for step in (50, 100):
        ck.save({POLICY: ckpt}, TrainerState(step=step))
    step_dir = run / "checkpoints" / "step_100"
    assert resolve_checkpoint(run) == step_dir / POLICY == resolve_checkpoint(step_dir)
    assert resolve_checkpoint(run / "checkpoints" / "step_50") == run / "checkpoints" / "step_50" / POLICY
    (run / "checkpoints" / "latest").write_text("step_50")
    assert resolve_checkpoint(run) == run / "checkpoints" / "step_50" / POLICY
    out = megatron_to_hf(run, tmp_path / "hf", max_shard_bytes=2**20)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1
    ref = load_file(hf_dir / "model.safetensors")
    for name, fname in index["weight_map"].items():
        with safe_open(out / fname, "pt") as f:
            assert torch.equal(f.get_tensor(name), ref[name]), name
    (run / "checkpoints" / "latest").unlink()
    with pytest.raises(ValueError, match="no complete checkpoint yet"):
        resolve_checkpoint(run)
    with pytest.raises(ValueError, match="is not a checkpoint"):
        resolve_checkpoint(tmp_path)


def test_hf_to_megatron_writes_in_process_and_megatron_core_reads_it(make_tiny_hf, tmp_path):
    """The in-process writer starts no helper process, leaves torch's CRC option as it was, and
    writes a torch_dist checkpoint that megatron-core itself recognises and loads."""
    import multiprocessing

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from checkpoints_tools.convert import _model_templates, hf_to_megatron
    from megatron_tir.policy.checkpoint.hf_io import HFReader
    from megatron_tir.policy.keymap import plan

    hf_dir = make_tiny_hf("qwen2", tie_word_embeddings=False)
    before_crc = torch.serialization.get_crc32_options()
    before_queue = filesystem_async._results_queue
    ckpt = hf_to_megatron(hf_dir, tmp_path / "ckpt")
    assert torch.serialization.get_crc32_options() == before_crc
    assert not multiprocessing.active_children()
    assert filesystem_async._results_queue is before_queue  # megatron-core's async writer did not run
    assert json.loads((ckpt / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    assert [p.name for p in ckpt.glob("*.distcp")] == ["__0_0.distcp"]
    spec = read_meta(ckpt).spec
    templates = _model_templates(spec)
    for t in templates.values():
        if isinstance(getattr(t, "data", None), torch.Tensor) and t.data.is_meta:
            t.data = torch.empty(t.data.shape, dtype=spec.torch_dtype)
    loaded = dist_checkpointing.load(templates, str(ckpt))
    reader = HFReader(hf_dir)
    fc2 = loaded["model.decoder.layers.1.mlp.linear_fc2.weight"]
    assert torch.equal(fc2, reader.get("model.layers.1.mlp.down_proj.weight"))
    fc1 = loaded["model.decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([reader.get("model.layers.0.mlp.gate_proj.weight"),
                                       reader.get("model.layers.0.mlp.up_proj.weight")]))
    assert {p.megatron for p in plan(spec)} <= {k.removeprefix("model.") for k in loaded}


def _export_counts(caplog) -> tuple[int, int]:
    import re

    m = re.search(r"(\d+) of (\d+) tensors copied file to file, (\d+) read and rearranged", caplog.text)
    assert m, caplog.text
    return int(m.group(1)), int(m.group(3))


def test_export_copies_bytes_or_rearranges_a_tp2_checkpoint_bit_exactly(make_tiny_hf, convert_once, tmp_path,
                                                                       caplog):
    # A TP=1 checkpoint (what hf-to-megatron writes) exports by copying each tensor's bytes
    # file to file; a checkpoint written at TP=2 (chunks split across ranks) goes through the
    # in-memory path. Both must give the original tensors, bit for bit.
    import logging

    from checkpoints_tools.reshard import reshard

    hf_dir = make_tiny_hf("qwen2", tie_word_embeddings=False)
    ckpt = convert_once(hf_dir)
    with caplog.at_level(logging.INFO, logger="checkpoints_tools.convert"):
        _assert_same_tensors(hf_dir, megatron_to_hf(ckpt, tmp_path / "from-tp1"), tied=False)
    copied, rearranged = _export_counts(caplog)
    assert copied > 0 and rearranged == 0
    caplog.clear()
    tp2 = reshard(ckpt, tmp_path / "tp2", tp=2, pp=1)
    with caplog.at_level(logging.INFO, logger="checkpoints_tools.convert"):
        _assert_same_tensors(hf_dir, megatron_to_hf(tp2, tmp_path / "from-tp2"), tied=False)
    copied, rearranged = _export_counts(caplog)
    assert rearranged > 0  # split linear layers; norms are replicated and still copied


def test_raw_regions_are_the_stored_bytes(make_tiny_hf, convert_once):
    from megatron_tir.policy.checkpoint.dist_reader import RegionReader

    ckpt = convert_once(make_tiny_hf("llama", tie_word_embeddings=True))
    with RegionReader(ckpt) as reader:
        checked = 0
        for key, md in reader.metadata.state_dict_metadata.items():
            if not hasattr(md, "size"):
                continue
            size = tuple(md.size)
            box = ((1,) + (0,) * (len(size) - 1), (1,) + size[1:]) if "layers" in key else ((0,) * len(size), size)
            if "linear_fc1.weight" in key:  # stored as two halves: the whole is not one region
                assert reader.raw_region(key, *box, md.properties.dtype) is None
                box = ((1, size[1] // 2, 0), (1, size[1] // 2, size[2]))
            region = reader.raw_region(key, *box, md.properties.dtype)
            assert region is not None, key
            with open(region.path, "rb") as f:
                f.seek(region.offset)
                raw = f.read(region.length)
            assert raw == reader.read(key, *box).contiguous().view(torch.uint8).numpy().tobytes(), key
            other = torch.float16 if md.properties.dtype != torch.float16 else torch.float32
            assert reader.raw_region(key, *box, other) is None  # another dtype: needs a cast, no raw bytes
            checked += 1
        assert checked >= 6


@pytest.mark.slow
def test_moe_reshard_to_tp2_ep2_and_back_to_hf_is_bit_exact(make_tiny_hf, convert_once, tmp_path):
    """HF -> Megatron -> resharded on 4 ranks at TP=2 x EP=2 (each rank holds 4 of the 8 experts,
    each split in two) -> HF: every tensor, the per-expert ones included, bit-exact."""
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    from checkpoints_tools.reshard import reshard

    hf_dir = make_tiny_hf("qwen3_moe", tie_word_embeddings=False)
    out = reshard(convert_once(hf_dir), tmp_path / "tp2ep2", tp=2, pp=1, ep=2)
    stored = load_sharded_metadata(str(out))
    experts = [k for k in stored if k.startswith("model.decoder.layers.mlp.experts.experts.linear_fc2.weight")]
    assert experts and tuple(stored[experts[0]].global_shape) == (2, 8, 64, 32)  # (layers, experts, h, f)
    writers = {p.name.split("_")[2] for p in out.glob("__*_*.distcp")}
    assert writers == {"0", "1", "2", "3"}
    back = megatron_to_hf(out, tmp_path / "hf")
    _assert_same_tensors(hf_dir, back, tied=False)

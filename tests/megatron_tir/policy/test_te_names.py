"""Spec-agnostic weights: the key map resolves every key of the local and the Transformer Engine
layer spec both ways, and a TE-style checkpoint (``_extra_state`` included) converts to HF and
back on CPU with equal logits.

TE is not installed here, so the TE names come from megatron-core itself: the sharded keys it
gives the local spec's tensors (its ``sharded_state_dict_keys_map`` maps them onto the TE
spec's fused names; TE's modules hold those names as parameters), and the op-fuser names of
``get_gpt_layer_with_transformer_engine_spec``'s own map, read from megatron-core's source
(the function cannot run without TE). A "TE-style" model here is the local spec whose core
attention carries an ``_extra_state`` in its state dict but not in its sharded state dict, as
megatron-core's ``TEDotProductAttention`` does, and whose linears carry non-empty ones (saved
as ``ShardedObject``s, as TE's are).
"""

from __future__ import annotations

import ast
import inspect
import io

import pytest
import torch

from megatron_tir.policy import keymap
from megatron_tir.policy.checkpoint.layout import MODEL_PREFIX


def _te_spec_keys_map_from_megatron_core() -> dict:
    from megatron.core.models.gpt import gpt_layer_specs

    tree = ast.parse(inspect.getsource(gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec))
    maps = [ast.literal_eval(kw.value) for node in ast.walk(tree) if isinstance(node, ast.Call)
            for kw in node.keywords if kw.arg == "sharded_state_dict_keys_map"]
    assert len(maps) == 1, maps
    return maps[0]


def test_the_prefix_maps_are_megatron_cores():
    from megatron.core.models.gpt import gpt_layer_specs

    local = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")
    assert keymap.LOCAL_SPEC_KEYS_MAP == local.submodules.sharded_state_dict_keys_map
    assert keymap.TE_SPEC_KEYS_MAP == _te_spec_keys_map_from_megatron_core()


@pytest.mark.parametrize("family,tied", [("qwen2", False), ("llama", True), ("qwen3", False)])
def test_every_key_of_both_specs_resolves_through_the_key_map_both_ways(parallel_1x1, family, tied):
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensorFactory

    from megatron_tir.policy.build import build_gpt_model
    from megatron_tir.policy.spec import ModelSpec
    from tiny_models import tiny_config

    spec = ModelSpec.from_hf(tiny_config(family, tie_word_embeddings=tied, num_layers=3))
    plans = {p.megatron: p for p in keymap.plan(spec)}
    by_hf = {n: p for p in plans.values() for n in p.hf}
    model = build_gpt_model(spec, meta=True, use_te=False)
    seen, te_op_fuser = set(), {v: k for k, v in keymap.TE_SPEC_KEYS_MAP.items()}
    for name, entry in model.sharded_state_dict(prefix=MODEL_PREFIX).items():
        name = name.removeprefix(MODEL_PREFIX)
        if isinstance(entry, ShardedObject):
            assert keymap.is_extra_state(name) and keymap.is_extra_state(entry.key)
            continue
        if name == "output_layer.weight" and tied:
            continue  # the tied head is the embedding
        leaf = entry.build()[0] if isinstance(entry, ShardedTensorFactory) else entry
        layer = leaf.global_offset[0] if leaf.prepend_axis_num else None
        key = entry.key.removeprefix(MODEL_PREFIX)  # megatron-core's own sharded key
        te_name = key if layer is None else key.replace("decoder.layers.", f"decoder.layers.{layer}.", 1)
        names = [name, te_name]  # local spec, TE spec (= the sharded name)
        rest = te_name.split(".", 3)[-1] if layer is not None else None
        if rest in te_op_fuser:  # TE's op-fuser MLP names the same tensors otherwise
            names.append(f"decoder.layers.{layer}.{te_op_fuser[rest]}")
        for n in names:
            p = plans[keymap.local_name(n)]  # state-dict name of either spec -> the key map ...
            assert keymap.sharded_key(n) == (key, layer) and p.sharded == te_name
            assert {by_hf[h].megatron for h in p.hf} == {p.megatron}  # ... -> HF -> back
        assert p.megatron == name
        seen.add(p.megatron)
    assert seen == set(plans)  # and every key-map entry is a key of the model


class _TEStyleExtraState:
    """``get_extra_state`` / ``set_extra_state`` as TE's modules have them (a serialised blob)."""

    def get_extra_state(self):
        return io.BytesIO(b"fp8 meta of " + type(self).__name__.encode())

    def set_extra_state(self, state):
        self.loaded_extra_state = state


def _te_style_layer_spec(monkeypatch):
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from megatron_tir.policy import build
    from megatron_tir.policy.attention import SdpaDotProductAttention

    attention = type("TEStyleAttention", (_TEStyleExtraState, SdpaDotProductAttention), {})
    column = type("TEStyleColumn", (_TEStyleExtraState, ColumnParallelLinear), {})
    row = type("TEStyleRow", (_TEStyleExtraState, RowParallelLinear), {})

    def layer_spec(spec, *, use_te=None):
        s = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")
        attn, mlp = s.submodules.self_attention.submodules, s.submodules.mlp.submodules
        attn.core_attention, attn.linear_qkv, attn.linear_proj = attention, column, row
        mlp.linear_fc1, mlp.linear_fc2 = column, row
        return s

    monkeypatch.setattr(build, "layer_spec", layer_spec)


def _hf_logits(hf_dir, ids):
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()(ids).logits


def test_te_style_checkpoint_with_extra_state_converts_to_hf_and_back(parallel_1x1, make_tiny_hf, tmp_path,
                                                                     monkeypatch):
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata
    from safetensors.torch import load_file

    from checkpoints_tools.convert import hf_to_megatron, megatron_to_hf
    from megatron_tir.policy.build import build_gpt_model
    from megatron_tir.policy.checkpoint.megatron_io import load_model, save_model
    from megatron_tir.policy.forward import forward_logits
    from megatron_tir.policy.spec import spec_from_hf_dir
    from megatron_tir.policy.weights import hf_buckets, load_hf_weights

    hf_dir = make_tiny_hf("qwen2", tie_word_embeddings=False)
    spec, config = spec_from_hf_dir(hf_dir)
    ids = torch.randint(0, spec.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    want = _hf_logits(hf_dir, ids)
    plain = build_gpt_model(spec)  # the local spec as it is
    _te_style_layer_spec(monkeypatch)
    te_style = build_gpt_model(spec)
    load_hf_weights(te_style, hf_dir, spec)  # the loader takes the model's own sharded keys
    exported = {n: t for _, bucket in hf_buckets(te_style, spec, 1 << 30) for n, t in bucket}  # and the export
    (tmp_path / "te").mkdir()
    save_model(te_style, tmp_path / "te", spec=spec, hf_config=config, hf_files=hf_dir)
    assert "decoder.layers.0.self_attention.core_attention._extra_state" in te_style.state_dict()
    stored = {k.split("/")[0] for k in load_sharded_metadata(str(tmp_path / "te"))}  # 'key/shard_<offset>_<shape>'
    assert "model.decoder.layers.self_attention.linear_qkv._extra_state" in stored

    # a TE checkpoint converts on CPU: the same tensors, the same logits
    out = megatron_to_hf(tmp_path / "te", tmp_path / "hf")
    ref, got = load_file(hf_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert ref.keys() == got.keys() and all(torch.equal(ref[n], got[n]) for n in ref)
    assert exported.keys() == ref.keys() and all(torch.equal(ref[n], exported[n]) for n in ref)
    assert torch.equal(_hf_logits(out, ids), want)
    # ... and loads into the local spec
    load_model(plain, tmp_path / "te")
    assert (forward_logits(plain, ids) - want).abs().max() <= 1e-4

    # back: converted on CPU (empty _extra_state, none for the core attention), it loads into the
    # TE-style model
    cpu = hf_to_megatron(out, tmp_path / "cpu")
    fresh = build_gpt_model(spec)
    load_model(fresh, cpu)
    diff = (forward_logits(fresh, ids) - want).abs().max().item()
    print(f"TE-style checkpoint -> HF -> CPU checkpoint -> TE-style model: max |logits - transformers| = {diff:.2e}")
    assert diff <= 1e-4

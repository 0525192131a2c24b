"""The local engine takes Qwen3-MoE weights under the checkpoint's per-expert names (transformers
fuses the experts in memory): an update lands in the model exactly as loading those files would."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from engine_testing import run
from megatron_tir.rollout.engines.hf_names import file_named_tensors


def test_per_expert_names_update_the_fused_experts(make_engine, tiny_qwen3_moe, tmp_path):
    files = load_file(tiny_qwen3_moe / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    changed = {n: files[n] + torch.randn(files[n].shape, generator=gen)
               for n in ("model.layers.1.mlp.experts.3.gate_proj.weight", "model.layers.1.mlp.experts.3.up_proj.weight",
                         "model.layers.0.mlp.experts.7.down_proj.weight", "model.layers.0.mlp.gate.weight")}
    updated = tmp_path / "updated"
    shutil.copytree(tiny_qwen3_moe, updated)
    save_file({**files, **changed}, updated / "model.safetensors", metadata={"format": "pt"})
    reference = AutoModelForCausalLM.from_pretrained(updated, dtype=torch.float32).eval()
    ids = torch.randint(1, 1000, (1, 12), generator=gen)

    async def main():
        engine = make_engine(tiny_qwen3_moe, eos_token_ids=(0,))
        await engine.update_weights(list(changed.items()))
        with torch.no_grad():
            got = engine.model(ids).logits
        with pytest.raises(ValueError, match="unknown parameter"):
            await engine.update_weights([("model.layers.0.mlp.experts.8.down_proj.weight", files[
                "model.layers.0.mlp.experts.7.down_proj.weight"])])  # only 8 experts
        await engine.close()
        return got, file_named_tensors(engine.model)

    got, named = run(main())
    assert all(torch.equal(named[n], t) for n, t in changed.items())
    with torch.no_grad():
        assert torch.equal(got, reference(ids).logits)

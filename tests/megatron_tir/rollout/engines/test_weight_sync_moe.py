"""The weight sync carries every Qwen3-MoE tensor -- each expert's gate / up / down projection and
the router -- under SGLang's names (the checkpoint's per-expert HF names, which SGLang's
``Qwen3MoeForCausalLM.load_weights`` maps onto its fused experts) to a fake SGLang server process
serving the tiny MoE model; the served model then generates with exactly the sent weights.

The fake loads what it receives through the LocalEngine's ``update_weights``, which refuses an
unknown name or a wrong shape (as ``load_weights`` would fail on a missing parameter), so a tensor
under another name fails the sync instead of being dropped.
"""

from __future__ import annotations

import shutil
import sys

import pytest
import torch
from engine_testing import reference_logprobs, run
from safetensors.torch import load_file, save_file
from test_weight_sync import FAKE_SERVER, PROMPT, engine_and_sync, fake_state
from transformers import AutoModelForCausalLM

from megatron_tir.ports import free_port
from megatron_tir.rollout.engines.base import SamplingParams
from megatron_tir.rollout.engines.sglang import SGLangServer, SGLangServerConfig
from megatron_tir.rollout.sync import buckets_of

pytestmark = pytest.mark.slow


def test_every_expert_tensor_arrives_under_sglangs_name_and_is_served(tiny_qwen3_moe, tmp_path):
    files = load_file(tiny_qwen3_moe / "model.safetensors")
    gen = torch.Generator().manual_seed(7)
    sent = {name: t * (1.0 + 0.2 * torch.randn(t.shape, generator=gen)) for name, t in files.items()}
    updated = tmp_path / "updated"
    shutil.copytree(tiny_qwen3_moe, updated)
    save_file(sent, updated / "model.safetensors", metadata={"format": "pt"})
    reference = AutoModelForCausalLM.from_pretrained(updated, dtype=torch.float32).eval()
    experts = {n for n in files if ".mlp.experts." in n}
    layers = {n.split(".")[2] for n in experts}
    assert len(experts) == 3 * 8 * len(layers) and any(n.endswith("mlp.gate.weight") for n in files)

    server = SGLangServer(SGLangServerConfig(model_path=str(tiny_qwen3_moe), port=free_port(), random_seed=0,
                                             launcher=(sys.executable, str(FAKE_SERVER)),
                                             log_file=str(tmp_path / "server.log"))).start()
    try:
        server.wait_healthy(timeout_s=120, poll_s=0.2)

        async def main():
            engine, sync = engine_and_sync([server])
            async with engine:
                await sync.start()
                await sync.update(buckets_of(sorted(sent.items()), 64 << 10))
                out = await engine.generate(PROMPT, SamplingParams(max_new_tokens=8, temperature=1.0, seed=5))
                await sync.close()
            return out

        out = run(main(), timeout=180)
        state = fake_state(server.url)
    finally:
        server.stop()
    received = [n for r in state["received"] for n in r["names"]]
    assert sorted(received) == sorted(sent)  # every tensor once, experts and router included, under its HF name
    assert experts <= set(received)
    assert not state["contract_errors"]
    assert out.meta["weight_version"] == "1"
    torch.testing.assert_close(torch.tensor(out.logprobs), reference_logprobs(reference, PROMPT, out.token_ids, 1.0),
                               atol=1e-4, rtol=0)

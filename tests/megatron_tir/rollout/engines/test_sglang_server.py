"""The SGLang launcher and the trainer-side weight broadcast, on CPU.

The argv is checked against the CLI fields the installed SGLang declares. The process
tests launch fake_sglang.py (a schema-checking server over a LocalEngine) through the
same SGLangServer code, and broadcast weights over gloo to a server that joins the group
with SGLang's own ``init_custom_process_group``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from megatron_tir.rollout.sync.sglang import (
    DistributedWeightSync,
    DistributedWeightSyncConfig,
)
from megatron_tir.rollout.sync import buckets_of
from megatron_tir.rollout.engines.base import FinishReason, SamplingParams
from megatron_tir.rollout.engines.sglang import (
    SGLangEngine,
    SGLangEngineConfig,
    SGLangServer,
    SGLangServerConfig,
)
from transformers import AutoModelForCausalLM

from engine_testing import reference_logprobs, run
from sglang_schema import server_cli_flags
from megatron_tir.ports import free_port

FAKE_SERVER = Path(__file__).with_name("fake_sglang.py")



def test_argv_uses_only_flags_sglang_declares():
    cfg = SGLangServerConfig(model_path="/models/qwen2.5-7b", host="0.0.0.0", port=30001, tp_size=2, base_gpu_id=4,
                             mem_fraction_static=0.7, dtype="bfloat16", context_length=32768, random_seed=7,
                             enable_memory_saver=True, enable_deterministic_inference=True, skip_server_warmup=True,
                             log_level="warning")
    argv = cfg.argv()
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    flags = [a for a in argv[3:] if a.startswith("--")]
    assert set(flags) <= server_cli_flags(), set(flags) - server_cli_flags()
    pairs = dict(zip(argv[3::1], argv[4::1]))
    assert pairs["--model-path"] == "/models/qwen2.5-7b" and pairs["--tp-size"] == "2"
    assert pairs["--mem-fraction-static"] == "0.7" and pairs["--base-gpu-id"] == "4" and pairs["--port"] == "30001"
    assert {"--enable-memory-saver", "--enable-deterministic-inference", "--skip-server-warmup"} <= set(argv)
    assert cfg.url == "http://127.0.0.1:30001"


@pytest.mark.parametrize("overrides,message", [
    (dict(model_path=""), "model_path"), (dict(port=0), "port"), (dict(tp_size=0), "tp_size"),
    (dict(mem_fraction_static=1.5), "mem_fraction_static"), (dict(dtype="fp8"), "dtype"),
    (dict(context_length=0), "context_length"), (dict(launcher=()), "launcher"),
])
def test_server_config_validation(overrides, message):
    with pytest.raises(ValueError, match=message):
        SGLangServerConfig(**(dict(model_path="/m") | overrides))


def test_wait_healthy_reports_a_server_that_exits(tmp_path, tiny_llama):
    cfg = SGLangServerConfig(model_path=str(tiny_llama), port=free_port(), launcher=(sys.executable, str(FAKE_SERVER)),
                             extra_args=("--no-such-flag", "1"), log_file=str(tmp_path / "server.log"))
    server = SGLangServer(cfg).start()
    with pytest.raises(RuntimeError, match="(?s)exited with code 2.*SGLang has no flag"):
        server.wait_healthy(timeout_s=60, poll_s=0.2)
    assert server.stop() == 2


@pytest.mark.slow
def test_launch_generate_broadcast_weights_and_stop(tmp_path, tiny_qwen2):
    """A launched server answers like the model; weights broadcast over gloo change it exactly."""
    reference = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).eval()
    torch.manual_seed(3)
    with torch.no_grad():
        for p in reference.parameters():
            p.mul_(1.0 + 0.2 * torch.randn_like(p))
    new_weights = [(name, tensor.clone()) for name, tensor in reference.state_dict().items()]
    original = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).eval()

    cfg = SGLangServerConfig(model_path=str(tiny_qwen2), port=free_port(), random_seed=0, mem_fraction_static=0.5,
                             launcher=(sys.executable, str(FAKE_SERVER)), log_file=str(tmp_path / "server.log"))
    prompt = [1, 504, 3458, 314, 1470, 30]
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=5)

    async def main():
        engine = SGLangEngine(SGLangEngineConfig(server_urls=(cfg.url,), eos_token_ids=(0,),
                                                 health_check_interval_s=0))
        async with engine:
            await engine.wait_healthy(timeout_s=5)
            before = await engine.generate(prompt, params)
            sync = DistributedWeightSync(engine, DistributedWeightSyncConfig(
                master_address="127.0.0.1", master_port=free_port(), backend="gloo", timeout_s=60))
            await sync.start()
            await sync.update(buckets_of(new_weights, 64 << 10))
            after = await engine.generate(prompt, params)
            await sync.close()
        return before, after

    with SGLangServer(cfg) as server:
        server.wait_healthy(timeout_s=120, poll_s=0.2)
        before, after = run(main(), timeout=180)
        pid = server.process.pid
    assert server.process.returncode is not None
    with pytest.raises(ProcessLookupError):
        import os

        os.kill(pid, 0)
    assert before.finish_reason is after.finish_reason is FinishReason.LENGTH
    torch.testing.assert_close(torch.tensor(before.logprobs),
                               reference_logprobs(original, prompt, before.token_ids, 1.0), atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.tensor(after.logprobs),
                               reference_logprobs(reference, prompt, after.token_ids, 1.0), atol=1e-4, rtol=0)
    assert after.meta["weight_version"] == "1"

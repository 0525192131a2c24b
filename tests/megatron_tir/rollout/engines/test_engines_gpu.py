"""GPU checks (opt-in: ``pytest -m gpu``): a real SGLang server and the local engine on CUDA.

Needs ``sglang[srt]`` and a CUDA GPU. The model defaults to the embedded SmolLM2-135M;
set MEGATRON_TIR_GPU_MODEL to an HF directory to use another one.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys

import pytest
import torch
from engine_testing import run

from megatron_tir.rollout.engines.base import FinishReason, SamplingParams

pytestmark = pytest.mark.gpu


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gpu_model_dir():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from megatron_tir.model_sources import resolve_model

    return resolve_model(os.environ.get("MEGATRON_TIR_GPU_MODEL", "smollm2"))


def _teacher_forced_logprobs(model, prompt, tokens, temperature):
    ids = torch.tensor([list(prompt) + list(tokens)], device=model.device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    t = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits / t, dim=-1)
    return logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None]).squeeze(1).cpu()


def test_real_sglang_server_logprobs_match_a_forward_pass(gpu_model_dir, tmp_path):
    pytest.importorskip("sglang.srt.entrypoints.http_server", reason="needs sglang[srt]")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_tir.rollout.engines.eos import resolve_eos_token_ids
    from megatron_tir.rollout.engines.sglang import SGLangEngine, SGLangEngineConfig
    from megatron_tir.rollout.engines.sglang_server import SGLangServer, SGLangServerConfig

    tok = AutoTokenizer.from_pretrained(gpu_model_dir)
    prompts = [tok("def fibonacci(n):").input_ids, tok("The capital of France is").input_ids]
    cfg = SGLangServerConfig(model_path=str(gpu_model_dir), port=_free_port(), dtype="bfloat16",
                             mem_fraction_static=0.3, random_seed=0, log_file=str(tmp_path / "sglang.log"),
                             launcher=(sys.executable, "-m", "sglang.launch_server"))
    params = [SamplingParams(max_new_tokens=24, temperature=1.0, seed=1),
              SamplingParams(max_new_tokens=24, temperature=0.7, stop=(".",), seed=2)]

    async def main():
        config = SGLangEngineConfig(server_urls=(cfg.url,), eos_token_ids=resolve_eos_token_ids(gpu_model_dir))
        async with SGLangEngine(config) as engine:
            return await asyncio.gather(*(engine.generate(p, sp) for p, sp in zip(prompts, params)))

    with SGLangServer(cfg) as server:
        server.wait_healthy(timeout_s=600)
        outs = run(main(), timeout=300)

    model = AutoModelForCausalLM.from_pretrained(gpu_model_dir, dtype=torch.bfloat16).cuda().eval()
    for prompt, sp, out in zip(prompts, params, outs):
        assert out.finish_reason in (FinishReason.LENGTH, FinishReason.STOP, FinishReason.EOS)
        assert len(out.token_ids) == len(out.logprobs) > 0
        if out.finish_reason is FinishReason.STOP:
            assert out.matched_stop in tok.decode(out.token_ids)  # no_stop_trim: the stop text is kept
        ref = _teacher_forced_logprobs(model, prompt, out.token_ids, sp.temperature)
        diff = (torch.tensor(out.logprobs) - ref).abs()
        # bf16 kernels differ between SGLang and HF: compare in aggregate, loosely per token.
        assert diff.mean() < 0.05 and diff.max() < 0.5, diff


def test_local_engine_on_cuda_matches_a_forward_pass(gpu_model_dir):
    from transformers import AutoModelForCausalLM

    from megatron_tir.rollout.engines.local import LocalEngine, LocalEngineConfig

    async def main():
        engine = LocalEngine(LocalEngineConfig(model=str(gpu_model_dir), device="cuda", max_batch_size=4))
        prompts = [engine.tokenizer(t).input_ids for t in ("def f(x):", "Once upon a time", "1 + 1 =")]
        outs = await asyncio.gather(*(engine.generate(p, SamplingParams(max_new_tokens=16, seed=i))
                                      for i, p in enumerate(prompts)))
        await engine.close()
        return prompts, outs

    prompts, outs = run(main())
    model = AutoModelForCausalLM.from_pretrained(gpu_model_dir, dtype=torch.float32).cuda().eval()
    for prompt, out in zip(prompts, outs):
        ref = _teacher_forced_logprobs(model, prompt, out.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=2e-3, rtol=0)

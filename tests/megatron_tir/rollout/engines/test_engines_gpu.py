"""GPU checks (opt-in: ``pytest -m gpu``): a real SGLang server, its weight sync, the local engine on CUDA.

Needs ``sglang[srt]`` and a CUDA GPU. The model defaults to the embedded SmolLM2-135M;
set MEGATRON_TIR_GPU_MODEL to an HF directory to use another one.
"""

from __future__ import annotations

import asyncio
import os
import sys

import pytest
import torch
from megatron_tir.rollout.engines.base import FinishReason, SamplingParams

from engine_testing import run
from megatron_tir.ports import free_port as _free_port

pytestmark = pytest.mark.gpu



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
    from megatron_tir.rollout.engines.eos import resolve_eos_token_ids
    from megatron_tir.rollout.engines.sglang import (
        SGLangEngine,
        SGLangEngineConfig,
        SGLangServer,
        SGLangServerConfig,
    )
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
    from megatron_tir.rollout.engines.local import LocalEngine, LocalEngineConfig
    from transformers import AutoModelForCausalLM

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


def _checksums_in_child(payload: str) -> list[tuple[str, float]]:
    """Open a tensor payload the way an SGLang TP rank does (another process)."""
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    monkey_patch_torch_reductions()
    return [(name, float(tensor.double().sum())) for name, tensor in MultiprocessingSerializer.deserialize(payload)]


def test_tensor_payloads_open_in_another_process(gpu_model_dir):
    pytest.importorskip("sglang.srt.utils.patch_torch", reason="needs sglang[srt]")
    import multiprocessing

    from megatron_tir.rollout.sync.sglang import serialize_for_tp_ranks

    bucket = [("a", torch.randn(4, 3, device="cuda")), ("b", torch.arange(5, device="cuda", dtype=torch.bfloat16))]
    payloads = serialize_for_tp_ranks(bucket, 2)
    assert len(payloads) == 2 and all(isinstance(p, str) for p in payloads)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        got = [pool.apply(_checksums_in_child, (p,)) for p in payloads]
    want = [(name, float(t.double().sum())) for name, t in bucket]
    for sums in got:
        assert [n for n, _ in sums] == ["a", "b"]
        assert [s for _, s in sums] == pytest.approx([s for _, s in want], rel=1e-6)


@pytest.mark.parametrize("path", ["distributed", "tensor"])
def test_real_server_generate_pause_sync_resume_generate(gpu_model_dir, tmp_path, path):
    """generate -> (pause, sync, resume: one send) -> generate answers like the new weights."""
    pytest.importorskip("sglang.srt.entrypoints.http_server", reason="needs sglang[srt]")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_tir.rollout.sync import buckets_of
    from megatron_tir.rollout.sync.sglang import DistributedWeightSync, DistributedWeightSyncConfig, TensorWeightSync
    from megatron_tir.rollout.engines.eos import resolve_eos_token_ids
    from megatron_tir.rollout.engines.sglang import SGLangEngine, SGLangEngineConfig, SGLangServer, SGLangServerConfig

    two_gpus = torch.cuda.device_count() >= 2  # NCCL needs one GPU per rank; gloo stages through the host
    backend = "nccl" if two_gpus else "gloo"
    server_gpu = 1 if two_gpus and path == "distributed" else 0  # the tensor path shares the trainer's GPU
    cfg = SGLangServerConfig(model_path=str(gpu_model_dir), port=_free_port(), dtype="bfloat16",
                             mem_fraction_static=0.3, random_seed=0, base_gpu_id=server_gpu,
                             log_file=str(tmp_path / "sglang.log"))
    tok = AutoTokenizer.from_pretrained(gpu_model_dir)
    prompt = tok("def fibonacci(n):").input_ids
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0)
    original = AutoModelForCausalLM.from_pretrained(gpu_model_dir, dtype=torch.bfloat16).cuda().eval()
    updated = AutoModelForCausalLM.from_pretrained(gpu_model_dir, dtype=torch.bfloat16).cuda().eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in updated.parameters():
            p.mul_(1.0 + 0.3 * torch.randn_like(p))
    on_cuda = path == "tensor" or backend == "nccl"
    weights = [(n, t if on_cuda else t.cpu()) for n, t in updated.state_dict().items()]

    async def main():
        config = SGLangEngineConfig(server_urls=(cfg.url,), eos_token_ids=resolve_eos_token_ids(gpu_model_dir))
        async with SGLangEngine(config) as engine:
            before = await engine.generate(prompt, greedy)
            if path == "distributed":
                sync = DistributedWeightSync(engine, DistributedWeightSyncConfig(
                    master_address="127.0.0.1", master_port=_free_port(), backend=backend, timeout_s=300))
                await sync.start()
            else:
                sync = TensorWeightSync(engine)
                await sync.start()
            await sync.update(buckets_of(weights, 256 << 20))
            after = await engine.generate(prompt, greedy)
            if path == "distributed":
                await sync.close()
            return before, after

    with SGLangServer(cfg) as server:
        server.wait_healthy(timeout_s=600)
        before, after = run(main(), timeout=600)

    assert after.meta["weight_version"] == "1"
    for out, model, other in ((before, original, updated), (after, updated, original)):
        ref = _teacher_forced_logprobs(model, prompt, out.token_ids, 1.0)
        wrong = _teacher_forced_logprobs(other, prompt, out.token_ids, 1.0)
        assert (torch.tensor(out.logprobs) - ref).abs().mean() < 0.05
        assert (torch.tensor(out.logprobs) - wrong).abs().mean() > 0.2  # the weights really differ

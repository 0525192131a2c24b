"""Qwen3 dense in the learner: log-probs equal transformers' (``Qwen3ForCausalLM``, QK-norm with
perturbed norm weights) at TP=1, TP=2 and PP=2; one Adam step gives the same loss, grad norm and
weights at every layout; the exported weights carry exactly the HF checkpoint's names."""

from __future__ import annotations

import pytest
import torch
from learner_testing import hf_logprobs, make_batch
from qwen3_testing import qwen3_run

from megatron_tir.policy.parallel import run_ranks

TINY = "tiny-qwen3"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3-tp1") / "result.pt"
    run_ranks(qwen3_run, 1, TINY, 1, 1, 1, str(out))
    return torch.load(out)


def _hf_names(hf_dir) -> set[str]:
    from safetensors import safe_open

    with safe_open(hf_dir / "model.safetensors", "pt") as f:
        return set(f.keys())


def test_tp1_logprobs_equal_transformers_and_the_export_has_the_hf_names(reference):
    from megatron_tir.model_sources import resolve_model

    hf_dir = resolve_model(TINY)
    probe = make_batch(1)
    ref, _ = hf_logprobs(hf_dir, probe.tokens_BT, probe.attention_mask_BT)
    diff = (reference["logprobs"] - ref).abs().max().item()
    print(f"parity {TINY} tp1: max |logp - transformers| = {diff:.2e}")
    assert diff <= 1e-4
    assert set(reference["weights"]) == _hf_names(hf_dir)  # q_norm / k_norm included, no qkv bias
    assert any(n.endswith("self_attn.q_norm.weight") for n in reference["weights"])
    # the step moved the weights, and transformers with them gives the learner's new log-probs
    after, _ = hf_logprobs(hf_dir, probe.tokens_BT, probe.attention_mask_BT, state_dict=reference["weights"])
    assert (after - reference["after"]).abs().max() <= 1e-4 and (after - ref).abs().max() > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_layouts_equal_tp1(tp, pp, reference, tmp_path):
    from megatron_tir.model_sources import resolve_model

    out = tmp_path / "result.pt"
    run_ranks(qwen3_run, tp * pp, TINY, tp, pp, 1, str(out))
    got = torch.load(out)
    probe = make_batch(1)
    ref, _ = hf_logprobs(resolve_model(TINY), probe.tokens_BT, probe.attention_mask_BT)
    diff = (got["logprobs"] - ref).abs().max().item()
    print(f"parity {TINY} tp={tp} pp={pp}: max |logp - transformers| = {diff:.2e}")
    assert diff <= 1e-4
    assert got["loss"] == pytest.approx(reference["loss"], rel=1e-5)
    assert got["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-4)
    assert got["weights"].keys() == reference["weights"].keys()
    # Adam's first step moves every weight by about lr (1e-3); summation order changes it by far less
    assert max((got["weights"][n] - reference["weights"][n]).abs().max().item() for n in got["weights"]) <= 1e-5

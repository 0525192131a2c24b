"""Qwen3-MoE in the learner (megatron-core's MoE layer, 8 experts, top-2): log-probs equal
transformers' (``Qwen3MoeForCausalLM``) before and after one Adam step (the step's weights exported
under the HF per-expert names and loaded by transformers); at EP=2 (each rank holds 4 experts; the
all-to-all dispatcher on CPU) and PP=2 the step equals EP=1's; TP > 1 without sequence parallelism
is refused in one line (megatron-core's MoE layer does not train under TP without it)."""

from __future__ import annotations

import pytest
import torch
from learner_testing import hf_logprobs, make_batch
from qwen3_testing import hf_dir_with, qwen3_run

from megatron_tir.policy.parallel import run_ranks

TINY = "tiny-qwen3-moe"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3-moe-tp1") / "result.pt"
    run_ranks(qwen3_run, 1, TINY, 1, 1, 1, str(out))  # the model's load-balancing loss (0.001) on
    return torch.load(out)


# The load-balancing loss is computed over each replica's own tokens (megatron-core's "aux_loss"),
# so its router gradient depends on the data-parallel split; without it the step is layout-free.
NO_AUX = {"moe_aux_loss_coeff": 0.0}


@pytest.fixture(scope="module")
def reference_no_aux(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3-moe-tp1-noaux") / "result.pt"
    run_ranks(qwen3_run, 1, TINY, 1, 1, 1, str(out), NO_AUX)
    return torch.load(out)


def _hf_names(hf_dir) -> set[str]:
    from safetensors import safe_open

    with safe_open(hf_dir / "model.safetensors", "pt") as f:
        return set(f.keys())


def test_logprobs_equal_transformers_before_and_after_a_step(reference, tmp_path):
    from megatron_tir.model_sources import resolve_model

    hf_dir = resolve_model(TINY)
    probe = make_batch(1)
    ref, _ = hf_logprobs(hf_dir, probe.tokens_BT, probe.attention_mask_BT)
    diff = (reference["logprobs"] - ref).abs().max().item()
    print(f"parity {TINY} tp1: max |logp - transformers| = {diff:.2e}")
    assert diff <= 1e-4 and reference["local_experts"] == 8
    names = set(reference["weights"])
    assert names == _hf_names(hf_dir)  # every expert tensor under its HF (and SGLang's) name
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names and "model.layers.0.mlp.gate.weight" in names
    after, _ = hf_logprobs(hf_dir_with(reference["weights"], hf_dir, tmp_path / "after"), probe.tokens_BT,
                           probe.attention_mask_BT)
    diff_after = (after - reference["after"]).abs().max().item()
    print(f"parity {TINY} tp1 after one step: max |logp - transformers| = {diff_after:.2e}")
    assert diff_after <= 1e-4 and (after - ref).abs().max() > 1e-3  # the step moved the model


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 2), (1, 2, 1)], ids=["ep2", "pp2"])
def test_layouts_equal_ep1(tp, pp, ep, reference_no_aux, tmp_path):
    from megatron_tir.model_sources import resolve_model

    reference = reference_no_aux
    out = tmp_path / "result.pt"
    run_ranks(qwen3_run, tp * pp * ep, TINY, tp, pp, ep, str(out), NO_AUX)
    got = torch.load(out)
    assert got["local_experts"] == 8 // ep  # the experts really are split
    probe = make_batch(1)
    ref, _ = hf_logprobs(resolve_model(TINY), probe.tokens_BT, probe.attention_mask_BT)
    diff = (got["logprobs"] - ref).abs().max().item()
    print(f"parity {TINY} tp={tp} pp={pp} ep={ep}: max |logp - transformers| = {diff:.2e}")
    assert diff <= 1e-4
    assert got["loss"] == pytest.approx(reference["loss"], rel=1e-5)
    assert got["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-4)
    assert got["weights"].keys() == reference["weights"].keys()  # experts of every EP rank exported
    assert max((got["weights"][n] - reference["weights"][n]).abs().max().item() for n in got["weights"]) <= 1e-5


@pytest.mark.slow
def test_tp2_without_sequence_parallelism_is_refused(tmp_path):
    with pytest.raises(ValueError, match="sequence_parallel"):
        run_ranks(qwen3_run, 2, TINY, 2, 1, 1, str(tmp_path / "x.pt"))

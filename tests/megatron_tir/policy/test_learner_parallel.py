"""The learner at TP=2, PP=2, TP=2 x PP=2, DP=2 (plain and distributed optimizer), on gloo ranks:
log-probs equal transformers', and loss, grad norm and the weights after two Adam steps equal
TP=1's; weights exported at TP=2 x PP=2 into a LocalEngine give the Megatron log-probs;
SmolLM2-135M log-probs at TP=3 and PP=2 equal transformers'."""

from __future__ import annotations

import pytest
import torch
from learner_testing import hf_logprobs, layout_run, logprobs_run, make_batch

from megatron_tir.policy.parallel import run_ranks

LAYOUTS = {"tp2": (2, 1, 2, False), "pp2": (1, 2, 2, False), "tp2pp2": (2, 2, 4, False),
           "dp2": (1, 1, 2, False), "dp2-distopt": (1, 1, 2, True)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp1") / "result.pt"
    run_ranks(layout_run, 1, 1, 1, False, str(out), False)
    return torch.load(out)


def _max_weight_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_equals_tp1(layout, reference, tmp_path):
    from megatron_tir.model_sources import resolve_model

    tp, pp, world, distopt = LAYOUTS[layout]
    out = tmp_path / "result.pt"
    run_ranks(layout_run, world, tp, pp, distopt, str(out), layout == "tp2pp2")
    got = torch.load(out)
    probe = make_batch(1)
    ref_lp, ref_ent = hf_logprobs(resolve_model("tiny-qwen2"), probe.tokens_BT, probe.attention_mask_BT,
                                  temperature=0.7)
    diff = (got["logprobs"] - ref_lp).abs().max().item()
    print(f"parity tiny-qwen2 {layout}: max |logp - transformers| = {diff:.2e}, "
          f"max |weights - tp1| after 2 steps = {_max_weight_diff(got['weights'], reference['weights']):.2e}")
    assert diff <= 1e-4 and (got["entropy"] - ref_ent).abs().max() <= 1e-4
    assert (reference["logprobs"] - ref_lp).abs().max() <= 1e-4
    for (loss, norm, ratio, skipped), (rloss, rnorm, rratio, rskipped) in zip(got["steps"], reference["steps"]):
        assert not skipped and not rskipped
        assert loss == pytest.approx(rloss, rel=1e-5, abs=1e-6) and norm == pytest.approx(rnorm, rel=1e-4)
        assert ratio == pytest.approx(rratio, rel=1e-5)
    assert _max_weight_diff(got["weights"], reference["weights"]) <= 2e-6
    assert (got["after"] - reference["after"]).abs().max() <= 1e-4
    if layout == "tp2pp2":  # the exported weights, loaded into a LocalEngine, give the Megatron log-probs
        assert (got["engine_logprobs"] - got["after"]).abs().max() <= 1e-4
        assert (got["engine_logprobs"] - ref_lp).abs().max() > 1e-3  # the engine really got new weights


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(3, 1), (1, 2)], ids=["tp3", "pp2"])
def test_smollm2_logprobs_equal_transformers(tp, pp, smollm2_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = tok(["import math\nprint(math.sqrt(16))\n", "So the result is \\boxed{4}. Done"], return_tensors="pt",
              padding=True)
    tokens, mask = ids.input_ids, ids.attention_mask.bool()
    torch.save((tokens, mask), tmp_path / "ids.pt")
    run_ranks(logprobs_run, tp * pp, "smollm2", tp, pp, str(tmp_path / "ids.pt"), str(tmp_path / "lp.pt"))
    ref, _ = hf_logprobs(smollm2_dir, tokens, mask)
    diff = (torch.load(tmp_path / "lp.pt") - ref).abs().max().item()
    print(f"parity smollm2 tp={tp} pp={pp}: max |logp - transformers| = {diff:.2e}")
    assert diff <= 1e-4

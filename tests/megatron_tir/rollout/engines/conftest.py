"""Fixtures for the engine tests: tiny HF models and a LocalEngine factory."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_llama(make_tiny_hf):
    return make_tiny_hf("llama", tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_qwen2(make_tiny_hf):
    return make_tiny_hf("qwen2", tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_qwen3(make_tiny_hf):
    return make_tiny_hf("qwen3", tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_qwen3_moe(make_tiny_hf):
    return make_tiny_hf("qwen3_moe", tie_word_embeddings=False)


@pytest.fixture
def make_engine():
    """Factory for LocalEngines; call it inside the coroutine that uses the engine."""
    from megatron_tir.rollout.engines.local import LocalEngine, LocalEngineConfig

    def make(model, **overrides):
        return LocalEngine(LocalEngineConfig(model=str(model), **overrides))

    return make


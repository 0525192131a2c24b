"""A real sandbox cluster (LocalCluster, 2 workers) shared by the rollout tests."""

import pytest


@pytest.fixture(scope="session")
def sandbox_cluster():
    from sandbox_cluster import LocalCluster

    with LocalCluster(workers=2) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)

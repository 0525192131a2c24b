"""A real sandbox cluster (LocalCluster, 2 workers) shared by the rollout tests, a sandbox
client on it per test, and a math-verify verifier per module."""

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


@pytest.fixture(scope="module")
def verifier():
    from megatron_tir.reward import MathVerifier

    with MathVerifier() as v:
        yield v


@pytest.fixture
def sandbox(sandbox_cluster):
    from megatron_tir.rollout import ClusterSandbox

    sb = ClusterSandbox.connect(sandbox_cluster.address)
    yield sb
    sb.close()

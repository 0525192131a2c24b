"""Fixtures for the sandbox cluster tests: one shared local cluster with a secret in its workers' environment."""

from __future__ import annotations

import pytest
from sandbox_helpers import SECRET_NAME, SECRET_VALUE

from sandbox_cluster import LocalCluster, SandboxClient


@pytest.fixture(scope="session")
def cluster():
    with LocalCluster(workers=2, env={SECRET_NAME: SECRET_VALUE}, heartbeat_interval_s=0.2,
                      heartbeat_liveness=5) as c:
        yield c


@pytest.fixture()
def client(cluster):
    with SandboxClient(cluster.address) as c:
        yield c


@pytest.fixture(scope="session")
def one_slot():
    """One worker with one slot: every request runs on the same zygote."""
    with LocalCluster(workers=1, heartbeat_interval_s=0.2, heartbeat_liveness=5) as c:
        yield c

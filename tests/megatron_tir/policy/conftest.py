"""Fixtures for the policy tests: one TP=1 x PP=1 parallel state in the test process."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def parallel_1x1():
    from megatron_tir.policy.parallel import destroy_parallel, init_parallel

    init_parallel(1, 1)
    yield
    destroy_parallel()

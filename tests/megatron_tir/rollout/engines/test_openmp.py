"""release_idle_threads against the OS's own count of the process's threads: a thread's libgomp
team exists after a parallel op and is gone after the release."""

from __future__ import annotations

import concurrent.futures
import os
import sys
import time

import pytest
import torch
from megatron_tir.rollout.engines.openmp import release_idle_threads

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libgomp's pause is looked up in /proc")


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def settle(expected: int, timeout_s: float = 5.0) -> int:
    """The thread count once it reaches ``expected`` (a released team's threads exit just after the call)."""
    deadline = time.monotonic() + timeout_s
    while (n := os_threads()) != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return n


def test_a_released_team_ends_its_threads_and_comes_back_on_the_next_parallel_op():
    def in_a_fresh_thread() -> tuple[int, int, int, int, bool]:
        torch.set_num_threads(2)  # a team of 2: this thread and one libgomp thread (needs no second core)
        before = os_threads()
        big = torch.ones(1 << 22)  # filling it is a parallel region already (above torch's grain size)
        assert float(big.sum()) == float(1 << 22)
        with_team = os_threads()
        took = release_idle_threads()
        released = settle(with_team - 1)
        big.sum()
        return before, with_team, released, os_threads(), took

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        before, with_team, released, again, took = pool.submit(in_a_fresh_thread).result()
    assert took, "no libgomp with omp_pause_resource_all in this process (torch's CPU wheel ships one)"
    assert with_team == before + 1
    assert released == before
    assert again == before + 1


def test_release_outside_any_team_is_harmless():
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        assert pool.submit(release_idle_threads).result() is True  # a thread that never ran parallel work
    torch.ones(1 << 20).sum()  # the main thread's work still runs afterwards


def test_the_local_kind_hands_a_waiting_threads_team_back_and_a_server_kind_does_nothing():
    """Only the engine kind knows whether a thread that waits for it should give its OpenMP team back
    (``EngineKind.before_wait``, which ``RolloutService.waiting`` runs): the local engine computes in
    this process, SGLang's servers elsewhere."""
    from megatron_tir.rollout.factory import ENGINE_KINDS

    assert ENGINE_KINDS["sglang"].before_wait is None

    def in_a_fresh_thread() -> tuple[int, int]:
        torch.set_num_threads(2)
        torch.ones(1 << 22).sum()
        with_team = os_threads()
        ENGINE_KINDS["local"].before_wait()
        return with_team, settle(with_team - 1)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with_team, after = pool.submit(in_a_fresh_thread).result()
    assert after == with_team - 1

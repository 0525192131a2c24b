"""A dead broker is noticed within seconds (issue 37), not at the client's deadline (cell timeout +
60 s): a broker killed while a cell runs answers the waiting calls ``sandbox_error`` after
``broker_silence_s``; a restarted one answers what its predecessor had accepted at once; the
rollouts' sandbox counts calls lost in a row and says, in one line, that it is unavailable."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time

import pytest

from megatron_tir.rollout.sandbox import ClusterSandbox
from sandbox_cluster import LocalCluster, SandboxClient, Status
from sandbox_cluster.client import ClientConfig

CLI = [sys.executable, "-m", "sandbox_cluster.cli", "--log-level", "warning"]
SLOW_CELL = "import time; time.sleep(30); print('late')"


@pytest.fixture
def lone_broker(tmp_path):
    """A broker and one worker as processes of their own (nothing restarts the broker)."""
    broker = subprocess.Popen([*CLI, "broker", "--bind", f"ipc://{tmp_path}/c.sock", "--worker-bind",
                               f"ipc://{tmp_path}/w.sock"], stdout=subprocess.PIPE, text=True)
    worker = None
    try:
        endpoints = json.loads(broker.stdout.readline())
        worker = subprocess.Popen([*CLI, "worker", "--connect", endpoints["worker"], "--slots", "2", "--name", "w"])
        with SandboxClient(endpoints["client"]) as client:
            end = time.monotonic() + 60
            while sum(w.free for w in client.status().workers) < 2:
                assert time.monotonic() < end, "the worker did not register"
                time.sleep(0.1)
        yield broker, endpoints["client"]
    finally:
        for proc in (worker, broker):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def _kill_when_running(broker: subprocess.Popen, address: str, running: int) -> threading.Thread:
    def kill() -> None:
        with SandboxClient(address) as watcher:
            while watcher.status().in_flight < running:
                time.sleep(0.05)
        broker.kill()

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow
def test_a_killed_broker_is_noticed_within_seconds_by_both_clients(lone_broker):
    broker, address = lone_broker
    config = ClientConfig(heartbeat_s=0.5, broker_silence_s=3.0)
    sandbox = ClusterSandbox(SandboxClient(address, config), max_lost_calls=2)

    async def two_calls():
        return await asyncio.gather(*(sandbox.execute(SLOW_CELL, timeout=40, memory_mb=256) for _ in range(2)))

    killer = _kill_when_running(broker, address, running=2)
    t0 = time.monotonic()
    results = asyncio.run(two_calls())
    elapsed = time.monotonic() - t0
    killer.join(5)
    assert broker.poll() is not None
    assert all(r.status is Status.SANDBOX_ERROR and "silent for" in r.message for r in results), results
    assert elapsed < 12, elapsed  # the client's deadline would be 100 s
    assert sandbox.unavailable is not None and sandbox.unavailable.startswith(
        "the sandbox is unavailable: 2 calls in a row failed (broker at ") and "\n" not in sandbox.unavailable
    sandbox.close()
    with SandboxClient(address, config) as client:  # the blocking client: the same bound
        t0 = time.monotonic()
        res = client.run("print(1)", timeout=40)
        assert res.status is Status.SANDBOX_ERROR and "silent for" in res.message, res
        assert time.monotonic() - t0 < 6
        assert client.broker_lost is not None


@pytest.mark.slow
def test_a_restarted_broker_answers_what_the_dead_one_had_accepted_at_once():
    with LocalCluster(workers=1) as cluster:
        with SandboxClient(cluster.address, ClientConfig(heartbeat_s=0.5, broker_silence_s=10.0)) as client:
            def kill() -> None:
                while cluster.status().in_flight < 1:
                    time.sleep(0.05)
                cluster.kill_broker()

            killer = threading.Thread(target=kill, daemon=True)
            killer.start()
            t0 = time.monotonic()
            res = asyncio.run(client.arun(SLOW_CELL, timeout=40))
            killer.join(5)
            assert res.status is Status.SANDBOX_ERROR and "restarted" in res.message, res
            assert time.monotonic() - t0 < 10
            cluster.wait_workers(60)
            again = asyncio.run(client.arun("print(6 * 7)", timeout=10))
            assert (again.status, again.stdout) == (Status.OK, "42\n"), again
            assert client.broker_lost is None

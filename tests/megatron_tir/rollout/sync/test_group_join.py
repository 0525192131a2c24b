"""Joining a weight-update group as its rank 0 (megatron_tir.rollout.sync.group_join): a join given up
ends its thread at once, whatever the servers did; the broadcast sync's hung join names the servers.

A given-up join left inside c10d aborted the process's exit when it came back during finalization
("terminate called without an active exception", 134 instead of 1; the per-stage sync's exit code is
checked in test_stage_sync_timeouts.py)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_tir.ports import free_port
from megatron_tir.rollout.sync.group_join import GroupJoin

FAKE_SERVER = Path(__file__).parents[1] / "engines" / "fake_sglang.py"


def test_a_join_given_up_while_waiting_for_the_servers_ends_its_thread_at_once():
    join = GroupJoin(master_address="127.0.0.1", master_port=free_port(), world_size=3, group_name="given-up",
                     backend="gloo", timeout_s=60)
    time.sleep(1.0)  # inside the store's wait for the two servers that never come
    assert not join.future.done()
    t0 = time.monotonic()
    assert join.cancel()  # True: the thread ended
    assert time.monotonic() - t0 < 5, "the join waited for its 60 s timeout"
    assert join.future.cancelled()


def test_a_given_up_join_keeps_its_store_listening_until_its_deadline():
    """A server whose /init_weights_update_group was cancelled may still connect: the store stays as long as the
    abandoned join's own timeout would have kept it (not gone with the thread), then goes."""
    from datetime import timedelta

    import torch.distributed as dist

    port = free_port()
    join = GroupJoin(master_address="127.0.0.1", master_port=port, world_size=3, group_name="listening",
                     backend="gloo", timeout_s=6)
    time.sleep(0.5)
    assert join.cancel()
    late = dist.TCPStore("127.0.0.1", port, world_size=1, is_master=False, timeout=timedelta(seconds=2))
    late.set("late", "1")  # a late server's client reaches it
    time.sleep(max(0.0, join.deadline - time.monotonic()) + 1.0)
    with pytest.raises(Exception):  # noqa: B017, PT011 - c10d's connect error (DistNetworkError or RuntimeError)
        dist.TCPStore("127.0.0.1", port, world_size=1, is_master=False, timeout=timedelta(seconds=2))


def test_a_join_given_up_at_once():
    early = GroupJoin(master_address="127.0.0.1", master_port=free_port(), world_size=2, group_name="early",
                      backend="gloo", timeout_s=60)
    t0 = time.monotonic()
    assert early.cancel() and early.future.cancelled()  # before or inside its wait, whichever it reached
    assert time.monotonic() - t0 < 5


# the server's side as sglang 0.5.23 builds it (init_custom_process_group), in a process of its own (c10d
# registers group names process-wide)
SERVER = """
import sys
from datetime import timedelta
import torch.distributed as dist
from megatron_tir.rollout.sync.group_join import group_from_store
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), world_size=2, is_master=False, timeout=timedelta(seconds=30))
group_from_store(store, world_size=2, rank=1, group_name="completed", backend="gloo", timeout_s=30)
print("joined")
"""


def test_a_join_given_up_after_it_completed_leaves_its_group():
    from torch.distributed import distributed_c10d as c10d

    port = free_port()
    join = GroupJoin(master_address="127.0.0.1", master_port=port, world_size=2, group_name="completed",
                     backend="gloo", timeout_s=30)
    server = subprocess.run([sys.executable, "-c", SERVER, str(port)], capture_output=True, text=True, timeout=120)
    assert server.returncode == 0 and "joined" in server.stdout, server.stderr[-1500:]
    group = join.result(timeout=30)
    assert group in c10d._world.pg_map
    assert join.cancel() and not join.future.cancelled()
    assert group not in c10d._world.pg_map  # destroyed: nobody else would


@pytest.mark.slow
def test_the_broadcast_sync_join_the_servers_never_answer_ends_naming_them(tmp_path, monkeypatch):
    from megatron_tir.model_sources import resolve_model
    from megatron_tir.rollout.engines.sglang import SGLangEngine, SGLangEngineConfig, SGLangError, SGLangServer
    from megatron_tir.rollout.engines.sglang import SGLangServerConfig
    from megatron_tir.rollout.sync.sglang import DistributedWeightSync, DistributedWeightSyncConfig

    monkeypatch.setenv("FAKE_SGLANG_INIT_FAILURE", "hang")  # its join stuck before the rendezvous: no answer
    server = SGLangServer(SGLangServerConfig(model_path=str(resolve_model("tiny-qwen2")), port=free_port(),
                                             random_seed=0, launcher=(sys.executable, str(FAKE_SERVER)),
                                             log_file=str(tmp_path / "server.log"))).start()

    async def main():
        engine = SGLangEngine(SGLangEngineConfig(server_urls=(server.url,), eos_token_ids=(0,),
                                                 health_check_interval_s=0, control_timeout_s=120))
        sync = DistributedWeightSync(engine, DistributedWeightSyncConfig(
            master_address="127.0.0.1", master_port=free_port(), backend="gloo", timeout_s=4,
            group_name=f"hung-join-{server.config.port}"))
        async with engine:
            t0 = time.monotonic()
            with pytest.raises(SGLangError) as info:
                await sync.start()
            return str(info.value), time.monotonic() - t0, sync.group

    try:
        server.wait_healthy(timeout_s=120, poll_s=0.2)
        error, took, group = asyncio.run(main())
    finally:
        server.stop()
    # before: c10d's "Timed out after 5 seconds waiting for clients. 1/2 clients joined." (the trainer's own
    # store wait, the same timeout_s, gave up first)
    assert error == f"no answer to /init_weights_update_group (hung-join-{server.config.port}) from the servers " \
                    "within 4 s (timeout_s)", error
    assert 4 <= took < 4 + 10, f"took {took:.1f} s"
    assert group is None


def test_after_a_failed_rebuild_the_next_sync_rebuilds_again():
    """A rebuild whose join failed leaves no group: the next sync must not find "nothing changed" and broadcast
    with group=None (c10d's default group, the trainer's own ranks), but rebuild."""
    from types import SimpleNamespace

    from megatron_tir.rollout.sync.sglang import DistributedWeightSync, DistributedWeightSyncConfig

    class Engine:  # the servers all back, none stale, the same set as in the last group
        sync_targets = [SimpleNamespace(url="http://a", stale=False)]

        async def wait_servers_back(self, timeout_s):
            return []

        async def destroy_weights_update_group(self, name, best_effort=False):
            return None

    sync = DistributedWeightSync(Engine(), DistributedWeightSyncConfig(master_address="127.0.0.1", master_port=1))
    joins = []

    async def join(group_name, master_port, refresh=True):
        joins.append(group_name)
        sync.group = object()

    sync._join = join
    sync.members, sync.rebuilds, sync.group = ("http://a",), 1, None  # the last rebuild's join failed
    assert asyncio.run(sync.rejoin()) and len(joins) == 1
    assert not asyncio.run(sync.rejoin())  # a group again, nothing changed: no rebuild

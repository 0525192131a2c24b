"""Every call of the broadcast weight sync ends in bounded time with the server's own error.

A fake server process (fake_sglang.py through SGLangServer, really joining the group over gloo)
whose receive fails before the broadcast (``FAKE_SGLANG_RECEIVE_FAILURE``: it answers as sglang
0.5.23's scheduler does when its receive raises, 400 and "Failed to receive weights: <why>") or never
ends (``hang``: a scheduler stuck in its receive answers nothing). Before: the trainer's broadcast
waited out the group's timeout before the server's answer was read, and a hung receive waited ``control_timeout_s`` (600 s) per call.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest
import torch
from engine_testing import run

from megatron_tir.ports import free_port
from megatron_tir.rollout.engines.sglang import SGLangEngine, SGLangEngineConfig, SGLangError, SGLangServer, SGLangServerConfig
from megatron_tir.rollout.factory import InfrastructureError
from megatron_tir.rollout.sync import buckets_of
from megatron_tir.rollout.sync.base import Rank0WeightSync
from megatron_tir.rollout.sync.sglang import DistributedWeightSync, DistributedWeightSyncConfig

pytestmark = pytest.mark.slow

FAKE_SERVER = Path(__file__).with_name("fake_sglang.py")
REASON = "CUDA error: an illegal memory access was encountered"


def serve(tiny_qwen2, tmp_path, monkeypatch, failure: str) -> SGLangServer:
    monkeypatch.setenv("FAKE_SGLANG_RECEIVE_FAILURE", failure)  # the server process's environment
    server = SGLangServer(SGLangServerConfig(model_path=str(tiny_qwen2), port=free_port(), random_seed=0,
                                             launcher=(sys.executable, str(FAKE_SERVER)),
                                             log_file=str(tmp_path / "server.log"))).start()
    server.wait_healthy(timeout_s=120, poll_s=0.2)
    return server


def sync_once(server: SGLangServer, *, timeout_s: float) -> tuple[BaseException, float, SGLangEngine]:
    """Start a broadcast sync into ``server`` and send one bucket; (the error, seconds the update took)."""
    weights = [("model.embed_tokens.weight", torch.zeros(8, 4)), ("lm_head.weight", torch.zeros(8, 4))]

    async def main():
        engine = SGLangEngine(SGLangEngineConfig(server_urls=(server.url,), eos_token_ids=(0,),
                                                 health_check_interval_s=0))
        sync = DistributedWeightSync(engine, DistributedWeightSyncConfig(
            master_address="127.0.0.1", master_port=free_port(), backend="gloo", timeout_s=timeout_s,
            group_name=f"timeouts-{server.config.port}"))  # (a broken group stays registered in this process)
        async with engine:
            await sync.start()
            t0 = time.monotonic()
            try:
                await sync.update(buckets_of(weights, 1 << 20))
            except SGLangError as exc:
                error = exc
            else:
                raise AssertionError("the sync succeeded")
            took = time.monotonic() - t0
            assert sync.broken  # its broadcast is still waiting for the server, or timed out: dropped, not reused
            await sync.close()  # leaves the group on the server, drops the broken one here without waiting
            assert engine.paused is False  # generation resumed after the failure
        return error, took, engine

    return run(main(), timeout=timeout_s + 120)


def test_a_receive_the_server_refuses_fails_at_once_with_its_message(tiny_qwen2, tmp_path, monkeypatch):
    server = serve(tiny_qwen2, tmp_path, monkeypatch, REASON)
    try:
        error, took, _ = sync_once(server, timeout_s=60)
    finally:
        server.stop()
    assert f"Failed to receive weights: {REASON}" in str(error)
    assert took < 20, f"the server's refusal took {took:.0f} s to surface (the group's timeout is 60 s)"
    # the run's side: one line, the server's words (megatron-tir exits 1 on an InfrastructureError)
    with pytest.raises(InfrastructureError, match="weight sync failed: .*Failed to receive weights: CUDA error"):
        Rank0WeightSync(lambda source: (_ for _ in ()).throw(error)).update(object())


def test_a_receive_that_never_ends_fails_in_bounded_time(tiny_qwen2, tmp_path, monkeypatch):
    server = serve(tiny_qwen2, tmp_path, monkeypatch, "hang")
    try:
        error, took, _ = sync_once(server, timeout_s=10)
    finally:
        server.stop()
    # the server's answer and this rank's broadcast share timeout_s: whichever side gives up first is named
    assert re.search(r"no answer to bucket 0 \(2 tensors\) from the servers within 10 s"
                     r"|the broadcast of bucket 0 \(2 tensors\) failed: .*Timed out", str(error)), str(error)
    assert took < 10 + 40, f"a hung receive took {took:.0f} s"


QUICK_S = 3.0  # quick_control_timeout_s in the test below (control_timeout_s: 120)


@pytest.mark.parametrize("path", ["/begin_weight_update", "/flush_cache"])
def test_a_quick_control_call_that_never_ends_fails_within_its_own_bound(tiny_qwen2, tmp_path, monkeypatch, path):
    """sglang 0.5.23 answers these without waiting for requests or a load (SGLangEngineConfig.quick_control_timeout_s):
    a server that does not answer fails the sync within that bound, not control_timeout_s (600 s by default)."""
    monkeypatch.setenv("FAKE_SGLANG_HANG", path)  # the fake's scheduler never answers this call
    server = serve(tiny_qwen2, tmp_path, monkeypatch, "")
    weights = [("model.norm.weight", torch.ones(64))]  # tiny-qwen2's (the flush comes after a load that succeeded)

    async def main():
        engine = SGLangEngine(SGLangEngineConfig(server_urls=(server.url,), eos_token_ids=(0,),
                                                 health_check_interval_s=0, control_timeout_s=120,
                                                 quick_control_timeout_s=QUICK_S))
        sync = DistributedWeightSync(engine, DistributedWeightSyncConfig(
            master_address="127.0.0.1", master_port=free_port(), backend="gloo", timeout_s=60,
            group_name=f"quick-{server.config.port}"))
        async with engine:
            await sync.start()
            t0 = time.monotonic()
            with pytest.raises(SGLangError) as info:
                await sync.update(buckets_of(weights, 1 << 20))
            took = time.monotonic() - t0
            assert engine.paused is False  # generation resumed after the failure
            await sync.close()
        return str(info.value), took

    try:
        error, took = run(main(), timeout=180)
    finally:
        server.stop()
    assert error == f"{server.url}{path}: no answer within {QUICK_S:g} s"
    assert took < QUICK_S + 20 < 120, f"took {took:.0f} s"


def test_rank0_sync_turns_an_engine_failure_into_the_runs_one_line_stop():
    def load(source):
        raise SGLangError("http://h:1/update_weights_from_distributed answered 400: Failed to update\nparameter")

    with pytest.raises(InfrastructureError) as info:
        Rank0WeightSync(load).update(object())
    assert str(info.value) == ("weight sync failed: http://h:1/update_weights_from_distributed answered 400: "
                               "Failed to update parameter")
    with pytest.raises(ValueError, match="a bucket"):  # a defect stays what it is
        Rank0WeightSync(lambda source: (_ for _ in ()).throw(ValueError("weight sync: a bucket"))).update(object())

"""The per-stage weight sync (megatron_tir.rollout.sync.stages, the non-colocated SGLang path) ends a
bucket in bounded time with the server's own error (issue 37 item 7).

One rank (PP=1, so rank 0 both announces and broadcasts) syncs into a fake SGLang server process
(tests/megatron_tir/rollout/engines/fake_sglang.py, really joining the group over gloo) whose receive
fails before the broadcast (``FAKE_SGLANG_RECEIVE_FAILURE``: 400 and "Failed to receive weights: <why>",
as sglang 0.5.23's scheduler answers, managers/scheduler_components/weight_updater.py:209-210) or never
ends (``hang``); or whose join does (``FAKE_SGLANG_INIT_FAILURE``). Before: a refused receive surfaced
as the trainer's gloo timeout with the server's words lost, and a hung receive or join was waited for
``control_timeout_s`` (the HTTP bound), not the sync's ``timeout_s``.

The rank runs in a process of its own, which must exit as megatron-tir does on the run's one-line error
(1): a given-up group join left inside c10d aborted it at exit when the join came back during the
interpreter's finalization (134, "terminate called without an active exception"; group_join.py).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_tir.cli import EXIT_INFRASTRUCTURE

pytestmark = pytest.mark.slow

FAKE_SERVER = Path(__file__).parents[1] / "engines" / "fake_sglang.py"
REASON = "CUDA error: an illegal memory access was encountered"
TIMEOUT_S = 8.0  # the sync's timeout_s (the group's, one bucket's)
CONTROL_TIMEOUT_S = 120.0  # each HTTP control call's bound: what a hung receive cost before


class TwoTensors:
    """The smallest WeightSource the stage sync reads: one stage, one bucket of two tensors."""

    weight_dtype = torch.float32

    def __init__(self) -> None:
        self.weights = [("model.embed_tokens.weight", torch.zeros(8, 4)), ("lm_head.weight", torch.zeros(8, 4))]

    def bucket_layout(self, bucket_bytes: int):
        return [[[(n, tuple(t.shape)) for n, t in self.weights]]]

    def stage_buckets(self, bucket_bytes: int):
        yield 0, list(self.weights)


def failing_sync_run(url: str, out: str) -> int:
    """This process as one trainer rank syncing into ``url``; the exit code as megatron-tir's (cli.main:
    1 on the run's one-line InfrastructureError)."""
    from megatron_tir.policy.parallel import destroy_parallel, init_parallel
    from megatron_tir.rollout.engines.sglang import SGLangEngine, SGLangEngineConfig
    from megatron_tir.rollout.event_loop import EventLoopThread
    from megatron_tir.rollout.factory import InfrastructureError
    from megatron_tir.rollout.sync.stages import StageWeightSync, StageWeightSyncConfig

    init_parallel(1, 1)
    loop = EventLoopThread()
    engine = SGLangEngine(SGLangEngineConfig(server_urls=(url,), eos_token_ids=(0,), health_check_interval_s=0,
                                             control_timeout_s=CONTROL_TIMEOUT_S))
    loop.run(engine.start())
    sync = StageWeightSync(StageWeightSyncConfig(backend="gloo", timeout_s=TIMEOUT_S, address="127.0.0.1"),
                           engine=engine, submit=loop.submit)
    t0 = time.monotonic()
    try:
        sync.start()  # the join
        t0 = time.monotonic()
        sync.update(TwoTensors())
    except InfrastructureError as exc:
        result, code = {"error": str(exc), "took": time.monotonic() - t0, "paused": engine.paused}, EXIT_INFRASTRUCTURE
    else:
        result, code = {"error": None}, 0
    loop.run(engine.close())  # (the broken group is left to the process's exit)
    loop.close()
    destroy_parallel()
    torch.save(result, out)
    return code


def sync_into(failure: str, tmp_path, monkeypatch, variable: str = "FAKE_SGLANG_RECEIVE_FAILURE") -> dict:
    from megatron_tir.model_sources import resolve_model
    from megatron_tir.ports import free_port
    from megatron_tir.rollout.engines.sglang import SGLangServer, SGLangServerConfig

    monkeypatch.setenv(variable, failure)  # the server process's environment
    server = SGLangServer(SGLangServerConfig(model_path=str(resolve_model("tiny-qwen2")), port=free_port(),
                                             random_seed=0, launcher=(sys.executable, str(FAKE_SERVER)),
                                             log_file=str(tmp_path / "server.log"))).start()
    try:
        server.wait_healthy(timeout_s=120, poll_s=0.2)
        # the rank in a process of its own: its exit code is checked (a join left inside c10d aborted the
        # interpreter's exit: "terminate called without an active exception", 134 instead of 1)
        rank = subprocess.run([sys.executable, __file__, server.url, str(tmp_path / "result.pt")],
                              capture_output=True, text=True, timeout=TIMEOUT_S + 240)
    finally:
        server.stop()
    assert rank.returncode == EXIT_INFRASTRUCTURE and "terminate called" not in rank.stderr, \
        f"the rank exited {rank.returncode}: {rank.stderr[-1500:]}"
    result = torch.load(tmp_path / "result.pt", weights_only=False)
    assert result["error"] is not None, "the sync succeeded"
    assert "\n" not in result["error"] and result["paused"] is False  # one line; generation resumed
    return result


def test_a_refused_receive_ends_the_stage_sync_with_the_servers_words(tmp_path, monkeypatch):
    result = sync_into(REASON, tmp_path, monkeypatch)
    assert result["error"].startswith("weight sync failed: (sending the weights) on rank 0: ")
    assert f"/update_weights_from_distributed answered 400: Failed to receive weights: {REASON}" in result["error"]
    assert result["took"] < TIMEOUT_S + 30, f"took {result['took']:.0f} s"


def test_a_receive_that_never_ends_fails_the_stage_sync_within_its_timeout(tmp_path, monkeypatch):
    result = sync_into("hang", tmp_path, monkeypatch)
    assert f"no answer to bucket 0 of stage 0 (2 tensors) from the servers within {TIMEOUT_S:g} s" in result["error"]
    assert result["took"] < TIMEOUT_S + 40 < CONTROL_TIMEOUT_S, f"took {result['took']:.0f} s"


def test_a_refused_join_ends_the_stage_sync_at_once_with_the_servers_words(tmp_path, monkeypatch):
    result = sync_into("address already in use", tmp_path, monkeypatch, "FAKE_SGLANG_INIT_FAILURE")
    assert result["error"].startswith("weight sync failed: (joining the weight-update groups) on rank 0: ")
    # model_runner_components/weight_updater.py:142 (sglang 0.5.23), through http_server.py:1413-1417 (400)
    assert ("/init_weights_update_group answered 400: Failed to initialize custom process group: "
            "address already in use.") in result["error"]
    assert result["took"] < TIMEOUT_S, f"took {result['took']:.0f} s"


def test_a_join_that_never_ends_fails_the_stage_sync_within_its_timeout(tmp_path, monkeypatch):
    result = sync_into("hang", tmp_path, monkeypatch, "FAKE_SGLANG_INIT_FAILURE")
    assert "no answer to /init_weights_update_group (megatron_tir_weights-0-pp0) from the servers within 8 s" \
        in result["error"]
    assert result["took"] < TIMEOUT_S + 30 < CONTROL_TIMEOUT_S, f"took {result['took']:.0f} s"


if __name__ == "__main__":  # sync_into's rank
    sys.exit(failing_sync_run(*sys.argv[1:]))

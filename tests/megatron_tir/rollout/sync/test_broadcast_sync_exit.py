"""A trainer rank whose broadcast weight sync failed exits with the run's own code (1), not an abort.

After a bucket the server refused (the fake SGLang server's ``FAKE_SGLANG_RECEIVE_FAILURE``: it answers
400 "Failed to receive weights: <why>" as sglang 0.5.23's scheduler does, without receiving), the sync
raises the server's words at once while this rank's broadcast is still in flight: on gloo it lasts until
the group's timeout (``DistributedWeightSync.broken``). Before, its thread waited inside gloo's
``dist.broadcast``; coming back from it while the interpreter was finalizing, it aborted the process
("terminate called without an active exception", exit 134; megatron_tir/rollout/sync/group_join.py).

The rank runs in a process of its own, which ends as megatron-tir does on the run's one-line error
(``sys.exit(1)``) while the broadcast is in flight: the server keeps its end of the group (as a stuck
server does; one that leaves the group closes its connections and the broadcast fails at once). Once its interpreter finalizes past the broadcast's
timeout (a teardown as long as a real trainer's can be: the window is then certain, not a race), once
it exits at once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch

from megatron_tir.cli import EXIT_INFRASTRUCTURE

pytestmark = pytest.mark.slow

FAKE_SERVER = Path(__file__).parents[1] / "engines" / "fake_sglang.py"
REASON = "CUDA error: an illegal memory access was encountered"
TIMEOUT_S = 8.0  # the sync's timeout_s: the group's, so how long the refused bucket's broadcast waits
FINALIZED = "finalization spanned the broadcast's timeout"


class SlowFinalization:
    """Held by a module of its own, so it goes while the interpreter finalizes (modules are cleared after
    the daemon threads were told to exit); sleeps there until ``until`` (time.monotonic)."""

    def __init__(self, until: float) -> None:
        self.until = until

    def __del__(self, sleep=time.sleep, monotonic=time.monotonic, stderr=sys.stderr) -> None:
        sleep(max(0.0, self.until - monotonic()))
        print(FINALIZED, file=stderr, flush=True)


def failing_sync_run(url: str, out: str, finalize: str) -> int:
    """This process as rank 0 syncing into ``url`` through the broadcast sync; exits as megatron-tir
    (cli.main: 1 on the run's one-line InfrastructureError)."""
    from megatron_tir.ports import free_port
    from megatron_tir.rollout.engines.sglang import SGLangEngine, SGLangEngineConfig
    from megatron_tir.rollout.event_loop import EventLoopThread
    from megatron_tir.rollout.factory import InfrastructureError
    from megatron_tir.rollout.sync import buckets_of
    from megatron_tir.rollout.sync.base import Rank0WeightSync
    from megatron_tir.rollout.sync.sglang import DistributedWeightSync, DistributedWeightSyncConfig

    weights = [("model.embed_tokens.weight", torch.zeros(8, 4)), ("lm_head.weight", torch.zeros(8, 4))]
    loop = EventLoopThread()
    engine = SGLangEngine(SGLangEngineConfig(server_urls=(url,), eos_token_ids=(0,), health_check_interval_s=0))
    loop.run(engine.start())
    sync = DistributedWeightSync(engine, DistributedWeightSyncConfig(
        master_address="127.0.0.1", master_port=free_port(), backend="gloo", timeout_s=TIMEOUT_S,
        group_name=f"exit-{os.getpid()}"))  # (the server keeps the group: one name per run)
    loop.run(sync.start())
    t0 = time.monotonic()  # the broadcast starts after this: its timeout comes before t0 + TIMEOUT_S + 1
    try:
        Rank0WeightSync(lambda source: loop.run(sync.update(buckets_of(source, 1 << 20)))).update(weights)
    except InfrastructureError as exc:
        result, code = {"error": str(exc), "took": time.monotonic() - t0}, EXIT_INFRASTRUCTURE
    else:
        result, code = {"error": None}, 0
    # the group is not left on the server (a stuck server does not answer /destroy_weights_update_group;
    # one that leaves its group closes its connections, and the broadcast fails at once)
    loop.run(engine.close())
    loop.close()
    result["sending"] = any(t.name == "weight-sync-send" and t.is_alive() for t in threading.enumerate())
    result["left_s"] = t0 + TIMEOUT_S - time.monotonic()  # the broadcast's time left, at least
    torch.save(result, out)
    if finalize == "slow":
        held = types.ModuleType("slow_finalization")
        held.finalizer = SlowFinalization(until=t0 + TIMEOUT_S + 3.0)
        sys.modules[held.__name__] = held
    return code


@pytest.fixture(scope="module")
def refusing_server(tmp_path_factory):
    from megatron_tir.model_sources import resolve_model
    from megatron_tir.ports import free_port
    from megatron_tir.rollout.engines.sglang import SGLangServer, SGLangServerConfig

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FAKE_SGLANG_RECEIVE_FAILURE", REASON)  # the server process's environment
        server = SGLangServer(SGLangServerConfig(
            model_path=str(resolve_model("tiny-qwen2")), port=free_port(), random_seed=0,
            launcher=(sys.executable, str(FAKE_SERVER)),
            log_file=str(tmp_path_factory.mktemp("server") / "server.log"))).start()
    try:
        server.wait_healthy(timeout_s=120, poll_s=0.2)
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("finalize", ["slow", "at_once"])
def test_a_rank_whose_broadcast_sync_failed_exits_with_the_runs_code(refusing_server, finalize, tmp_path):
    rank = subprocess.run([sys.executable, __file__, refusing_server.url, str(tmp_path / "result.pt"), finalize],
                          capture_output=True, text=True, timeout=TIMEOUT_S + 240)
    assert rank.returncode == EXIT_INFRASTRUCTURE and "terminate called" not in rank.stderr, \
        f"the rank exited {rank.returncode}: {rank.stderr[-1500:]}"
    result = torch.load(tmp_path / "result.pt", weights_only=False)
    assert result["error"] is not None, "the sync succeeded"
    assert result["error"].startswith("weight sync failed: ") and f"Failed to receive weights: {REASON}" in \
        result["error"]
    assert result["took"] < TIMEOUT_S, f"the refusal took {result['took']:.1f} s"
    # the hazard was there: the process ended with its broadcast in flight ...
    assert result["sending"] and result["left_s"] > 0, result
    if finalize == "slow":  # ... and, here, its interpreter was still finalizing when the broadcast timed out
        assert FINALIZED in rank.stderr, rank.stderr[-1500:]


if __name__ == "__main__":  # the rank
    sys.exit(failing_sync_run(*sys.argv[1:]))

"""Rank-0-only phases never leave the other ranks inside a collective with a watchdog
(../shared/DESIGN.md, "The rule that keeps a cluster alive"), and the rows travel once per TP group."""

from __future__ import annotations

import json
import time

import pytest
import torch
from source_ranks import handoff_rank, slow_eval_train_rank

from megatron_tir.policy.parallel import run_ranks
from megatron_tir.rollout.factory import InfrastructureError

EVAL_S, TIMEOUT_S = 8.0, 3.0


@pytest.mark.slow  # two ranks, a real learner and two 8 s evaluations: ~40 s
def test_a_held_out_evaluation_longer_than_the_group_timeout_ends_the_run_on_every_rank(tmp_path):
    run_ranks(slow_eval_train_rank, 2, str(tmp_path), EVAL_S, TIMEOUT_S)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert [g["step"] for g in got] == [1, 1]
    assert got[0]["evaluations"] == 2  # step 0 and the last step, on rank 0 alone
    assert got[1]["elapsed"] >= 2 * EVAL_S - 0.5  # rank 1 waited through both, far past the 3 s timeout
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [ln["step"] for ln in lines] == [0, 1]
    assert all(ln["time/eval"] >= EVAL_S for ln in lines)


def test_the_watchdog_is_real_a_bare_collective_behind_a_busy_rank_0_times_out(tmp_path):
    """The control: without the hand-off, the same wait dies at the group's timeout (the issue's reproduction)."""
    from source_ranks import watchdog_rank

    run_ranks(watchdog_rank, 2, str(tmp_path), TIMEOUT_S, EVAL_S)
    got = torch.load(tmp_path / "rank1.pt")
    assert got["outcome"] != "completed" and TIMEOUT_S - 0.5 <= got["waited"] < EVAL_S - 1.0, got


def test_a_failure_in_a_rank0_phase_ends_the_waiting_ranks_with_its_cause():
    from megatron_tir.train.handoff import HandOff

    store = torch.distributed.HashStore()
    r0, r1 = HandOff.__new__(HandOff), HandOff.__new__(HandOff)
    for h, rank in ((r0, 0), (r1, 1)):
        h.store, h.rank, h.poll_s, h.alive_timeout_s = store, rank, 0.1, 5.0
    store.add("beat", 1)

    def evaluate():
        raise RuntimeError("server 2 answered 503")
    with pytest.raises(RuntimeError, match="503"):
        r0.rank0_phase("end/3", evaluate, what="rank 0 to end step 3")
    t0 = time.monotonic()
    with pytest.raises(InfrastructureError, match="rank 0 failed in rank 0 to end step 3: RuntimeError: server 2 "
                                                  "answered 503"):
        r1.rank0_phase("end/3", lambda: None, what="rank 0 to end step 3")
    assert time.monotonic() - t0 < 2.0
    assert r0.rank0_phase("end/4", lambda: {"reward": 0.5}, what="x") == {"reward": 0.5}
    assert r1.rank0_phase("end/4", lambda: None, what="x") == {"reward": 0.5}


@pytest.mark.parametrize("world,tp", [(2, 2), (4, 2)], ids=["tp2", "tp2xdp2"])
def test_rows_travel_once_per_tensor_parallel_group(tmp_path, world, tp):
    run_ranks(handoff_rank, world, str(tmp_path), tp)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for r, g in enumerate(got):
        assert g["rows"].keys() == g["expected"].keys()
        for name, t in g["expected"].items():
            torch.testing.assert_close(g["rows"][name], t, rtol=0, atol=0, msg=f"rank {r} {name}")
    share_bytes = [sum(v.numel() * v.element_size() for v in g["expected"].values()) for g in got]
    # rank 0 sends point to point only to the first rank of each other TP group: one copy per group
    leaders = sorted({min(t) for t in got[0]["tp_of"]} - {0})
    assert got[0]["sent"] == sum(share_bytes[r] for r in leaders)
    assert len(leaders) == world // tp - 1
    for r in range(1, world):  # every rank still holds exactly its share
        assert got[r]["received"] == share_bytes[r]


@pytest.mark.slow  # two ranks, a real learner, two steps: ~40 s
def test_colocated_every_rank_gives_its_training_memory_back_before_the_engine_resumes(tmp_path):
    from source_ranks import colocated_order_rank

    run_ranks(colocated_order_rank, 2, str(tmp_path))
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        events = [e if isinstance(e, str) else e[0] for e in got["events"]]
        # step 1: train, give back, sync; step 2: (engine releases) take back, train, give back, sync
        expected = ["offload_grad_buffers", "sync", "restore_grad_buffers", "offload_grad_buffers", "sync"]
        if rank == 0:  # rank 0 holds the engine: it releases its memory before each update
            expected = ["engine_release"] + expected[:2] + ["engine_release"] + expected[2:]
        assert events == expected, (rank, got["events"])
        assert [e[1] for e in got["events"] if not isinstance(e, str)] == [0, 0]  # nothing held at the syncs
        assert got["grad_bytes"] == 0  # released after the last update too

"""The hand-off across ranks (gloo; ``HandOff.take`` of rank 0's producer's rows, built by
``run.open_rollouts``): ranks wait for rank 0 however long its rollouts take, a dead rank 0 ends
them in bounded time, and each rank receives only the rows it trains, with the update of the
whole batch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from source_ranks import crafted_groups, dp_update_rank, slow_rollout_rank, source_config

from megatron_tir.policy.parallel import run_ranks
from megatron_tir.ports import free_port
from megatron_tir.rollout.factory import InfrastructureError
from megatron_tir.rollout.batch import collate
from megatron_tir.train.batch import deal_rows, plan_update

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


def test_a_rollout_longer_than_the_process_group_timeout_completes(tmp_path):
    run_ranks(slow_rollout_rank, 2, 10.0, str(tmp_path))
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["waited"] >= 9.5 and got["all_reduce"] == 2.0 and got["rows"] > 0


def test_a_dead_rank_0_ends_the_waiting_rank_in_bounded_time(tmp_path):
    port, marker = str(free_port()), tmp_path / "rolling"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{HERE}", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(HERE / "source_ranks.py"), str(r), "2", port, "600", str(marker)],
                              env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert time.monotonic() < deadline and procs[0].poll() is None, "rank 0 never started its rollout"
            time.sleep(0.2)
        time.sleep(2.0)  # rank 1 is waiting for the step's rows now
        assert procs[1].poll() is None
        procs[0].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        code = procs[1].wait(timeout=60)
        assert code != 0 and time.monotonic() - t0 < 60
        err = procs[1].stderr.read()
        assert "lost rank 0" in err or "rank 0 gave no sign of life" in err, err[-2000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_rank_0_without_heartbeat_is_given_up_after_the_alive_timeout():
    from megatron_tir.train.handoff import HandOff

    h = HandOff.__new__(HandOff)  # the wait alone, on a store where rank 0 never writes again
    h.store, h.rank, h.poll_s, h.alive_timeout_s = torch.distributed.HashStore(), 1, 0.2, 1.0
    h.store.add("beat", 1)
    t0 = time.monotonic()
    with pytest.raises(InfrastructureError, match="rank 0 gave no sign of life for 1 s"):
        h._wait("step/1", what="step 1's rollouts")
    assert 1.0 <= time.monotonic() - t0 < 5.0


def _expected_shares(dp: int):
    cfg = source_config(prompts=4, mini_batches=2)
    plan = plan_update(collate(crafted_groups(0, 4), pad_id=0), mode=cfg.trainer.mode,
                       advantage=cfg.trainer.ppo.advantage, overlong=cfg.trainer.filters.overlong, mini_batches=2)
    return plan, deal_rows(plan.rows, dp)


def test_each_data_parallel_rank_receives_only_its_rows_and_the_update_is_the_dp1_update(tmp_path):
    (tmp_path / "dp1").mkdir()
    (tmp_path / "dp2").mkdir()
    run_ranks(dp_update_rank, 1, str(tmp_path / "dp1"))
    run_ranks(dp_update_rank, 2, str(tmp_path / "dp2"))
    plan, shares = _expected_shares(2)
    whole = sum(v.numel() * v.element_size() for v in plan.rows.tensors().values())
    r0, r1 = (torch.load(tmp_path / "dp2" / f"received_rank{r}.pt") for r in (0, 1))
    # rank 1 received its share and nothing else (rank 0 keeps its own share, receives nothing)
    for name, t in shares[1].tensors().items():
        torch.testing.assert_close(r1["rows"][name], t, rtol=0, atol=0, msg=name)
    assert r1["bytes"] == sum(v.numel() * v.element_size() for v in shares[1].tensors().values()) < whole
    assert r0["bytes"] == 0
    assert r0["rows"]["tokens_BT"].shape[0] + r1["rows"]["tokens_BT"].shape[0] == plan.rows.batch_size
    # the void row shaped its group's advantages but was not sent anywhere
    assert int(plan.trained_B.sum()) == plan.rows.batch_size < plan.stats_B.numel()
    w1, w2 = torch.load(tmp_path / "dp1" / "weights.pt"), torch.load(tmp_path / "dp2" / "weights.pt")
    moved = 0
    for name, before in w1["initial"].items():
        torch.testing.assert_close(w2["initial"][name], before, rtol=0, atol=0, msg=name)
        step1, step2 = w1["updated"][name] - before, w2["updated"][name] - before
        torch.testing.assert_close(step2, step1, rtol=1e-4, atol=1e-6, msg=name)
        moved += float(step1.abs().max()) > 1e-4
    assert moved >= len(w1["initial"]) // 2  # the update changed the weights it is compared on
    m1 = torch.load(tmp_path / "dp1" / "received_rank0.pt")["metrics"]
    assert m1["train/optimizer_steps"] == 2.0 and m1["train/grad_norm"] > 0
    for key in ("train/loss", "train/grad_norm"):
        assert r0["metrics"][key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), key


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory):
    """tiny-qwen2's shape and tokenizer with 3 layers (a first, a middle and a last stage at PP=3)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    from megatron_tir.model_sources import TINY_QWEN2_CONFIG, resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("tiny-qwen2"))
    config = Qwen2Config(**(TINY_QWEN2_CONFIG | {"num_hidden_layers": 3}), bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    dest = tmp_path_factory.mktemp("three-layers")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(dest, safe_serialization=True)
    tok.save_pretrained(dest)
    return str(dest)


def _nbytes(tensors) -> int:
    return sum(v.numel() * v.element_size() for v in tensors)


@pytest.mark.slow  # ~40-60 s of CPU (4-5 processes), minutes of wall time on a shared machine
@pytest.mark.parametrize("pp,world", [(3, 3), (2, 4)], ids=["pp3", "pp2xdp2"])
def test_each_pipeline_stage_receives_only_what_it_reads_and_the_update_is_the_pp1_update(tmp_path, three_layers,
                                                                                          pp, world):
    model = three_layers if pp == 3 else "tiny-qwen2"  # 3 layers: a first, a middle and a last stage
    (tmp_path / "pp1").mkdir()
    (tmp_path / "pp").mkdir()
    run_ranks(dp_update_rank, 1, str(tmp_path / "pp1"), 1, model)
    run_ranks(dp_update_rank, world, str(tmp_path / "pp"), pp, model)
    plan, shares = _expected_shares(world // pp)
    got = [torch.load(tmp_path / "pp" / f"received_rank{r}.pt") for r in range(world)]
    assert sorted(g["view"] for g in got) == sorted((d, s == 0, s == pp - 1) for d in range(world // pp)
                                                    for s in range(pp))
    reads = {(True, False): {"tokens_BT", "attention_mask_BT", "mini_batch_B"},  # the embedding's input
             (False, False): {"attention_mask_BT", "mini_batch_B"},  # the micro-batch shapes only
             (False, True): set(shares[0].tensors())}  # everything the loss reads
    for rank, g in enumerate(got):
        dp, first, last = g["view"]
        rows = shares[dp]
        assert g["rows"].keys() == reads[first, last], (rank, g["view"])
        for name, t in g["rows"].items():  # this replica's rows, exactly
            torch.testing.assert_close(t, rows.tensors()[name], rtol=0, atol=0, msg=name)
        if rank == 0:  # it sampled them: nothing received
            assert g["bytes"] == 0
        elif not first and not last:  # the rows' lengths and mini-batches: nothing per token travels
            assert g["bytes"] == 2 * 8 * rows.batch_size
        else:
            assert g["bytes"] == _nbytes(t for name, t in rows.tensors().items() if name in reads[first, last])
        assert "versions_BT" not in g["rows"]  # rank 0 logs the weight versions; no rank receives them
    assert (pp == 3) == any(not f and not la for _, f, la in (g["view"] for g in got))  # pp3 has a middle stage
    w1, w = torch.load(tmp_path / "pp1" / "weights.pt"), torch.load(tmp_path / "pp" / "weights.pt")
    moved = 0
    for name, before in w1["initial"].items():
        torch.testing.assert_close(w["initial"][name], before, rtol=0, atol=0, msg=name)
        step1, step = w1["updated"][name] - before, w["updated"][name] - before
        torch.testing.assert_close(step, step1, rtol=1e-4, atol=1e-6, msg=name)
        moved += float(step1.abs().max()) > 1e-4
    assert moved >= len(w1["initial"]) // 2  # the update changed the weights it is compared on
    m1 = torch.load(tmp_path / "pp1" / "received_rank0.pt")["metrics"]
    assert m1["train/optimizer_steps"] == 2.0 and m1["train/grad_norm"] > 0
    if world > pp:  # the padding share is of every replica's micro-batches, which DP > 1 plans otherwise
        m1 = m1 | {"train/padding_share": _padding_share(shares)}
    for g in got:  # every rank logs the same metrics, whichever rows it holds
        assert g["metrics"].keys() == m1.keys()
        for key, want in m1.items():
            assert g["metrics"][key] == pytest.approx(want, rel=1e-4, abs=1e-6), key


def _padding_share(shares) -> float:
    """The mean over the mini-batches of the padding share of every replica's micro-batches (by hand)."""
    from megatron_tir.policy.microbatch import plan_microbatches

    per_step = []
    for k in range(int(shares[0].mini_batch_B.max()) + 1):
        real = padded = 0
        for share in shares:
            attn = share.attention_mask_BT[share.mini_batch_B == k]
            for mb in plan_microbatches(attn, max_tokens=24):
                real += sum(e - s for s, e in mb.spans)
                padded += len(mb.rows) * max(e - s for s, e in mb.spans)
        per_step.append(1 - real / padded)
    return sum(per_step) / len(per_step)


@pytest.mark.slow  # ~30 s of CPU (3 processes, a policy and a critic each)
def test_row_metrics_at_dp2_are_those_of_the_whole_batch(tmp_path):
    """The off-policy correction's and the critic's metrics are of every replica's rows (each rank holds
    its own), equal to DP=1's: means weighted by their token counts, maxima of the maxima."""
    (tmp_path / "dp1").mkdir()
    (tmp_path / "dp2").mkdir()
    run_ranks(dp_update_rank, 1, str(tmp_path / "dp1"), 1, "tiny-qwen2", True)
    run_ranks(dp_update_rank, 2, str(tmp_path / "dp2"), 1, "tiny-qwen2", True)
    m1 = torch.load(tmp_path / "dp1" / "received_rank0.pt")["metrics"]
    keys = [k for k in m1 if k.startswith(("offpolicy/", "critic/"))]
    assert {"offpolicy/weight_mean", "offpolicy/weight_max", "offpolicy/kl", "critic/explained_variance",
            "critic/value_mean_correct"} <= set(keys)
    assert m1["offpolicy/abs_dlogp_mean"] > 1  # the crafted engine log-probs are far from the learner's
    for rank in (0, 1):
        m2 = torch.load(tmp_path / "dp2" / f"received_rank{rank}.pt")["metrics"]
        for key in keys:
            assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), key

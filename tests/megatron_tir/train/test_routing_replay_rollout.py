"""``trainer.ppo.routing_replay=rollout``: the engine's routed experts ride with the trajectories into the
rollout batch and the trained rows (every pipeline stage gets them: each replays its own layers), and a
tiny-cpu step trains a Qwen3-MoE against a fake SGLang server that returns them (fake_sglang_routing.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch
from source_ranks import crafted_groups

from megatron_tir.rollout.batch import collate
from megatron_tir.train.batch import TrainRows, plan_update

ROOT = Path(__file__).resolve().parents[3]
FAKE_SERVER = ROOT / "tests" / "megatron_tir" / "rollout" / "engines" / "fake_sglang.py"


def test_routing_rides_with_the_rows():
    groups = crafted_groups(0, 2)
    for g in groups:
        for t in g.trajectories:
            n = len(t.prompt_ids) + len(t.response_ids) - 1  # the last token was never forwarded
            t.routed_experts = (torch.arange(n * 4, dtype=torch.int32).view(n, 4) + t.sample_index) % 8
    groups[1].trajectories[0].routed_experts = None  # an aborted trajectory: nothing reported
    rb = collate(groups, pad_id=0)
    assert rb.routed_experts_BTX.shape == (*rb.tokens_BT.shape, 4) and rb.routed_experts_BTX.dtype == torch.int16
    for b, t in enumerate(t for g in groups for t in g.trajectories):
        got = rb.routed_experts_BTX[b]
        if t.routed_experts is None:
            assert (got == -1).all()
        else:
            n = t.routed_experts.shape[0]
            assert torch.equal(got[:n].int(), t.routed_experts) and (got[n:] == -1).all()
    rows = plan_update(rb, mode="simpletir", advantage="grpo", overlong="keep", mini_batches=1).rows
    assert rows.routed_experts_BTX.shape[:2] == rows.attention_mask_BT.shape
    one = rows.select([2, 0])
    assert torch.equal(one.routed_experts_BTX, rows.routed_experts_BTX[[2, 0], :one.attention_mask_BT.shape[1]])
    both = TrainRows.cat([rows.select([0]), rows.select([1])])
    assert (both.routed_experts_BTX[0, rows.select([0]).attention_mask_BT.shape[1]:] == -1).all()  # padded with -1
    for first, last in ((True, False), (False, False), (False, True)):  # every stage replays its own layers
        sent = rows.for_stage(first=first, last=last)
        assert torch.equal(sent["routed_experts_BTX"], rows.routed_experts_BTX)
        assert torch.equal(TrainRows.from_stage(sent, rows.attention_mask_BT.shape[1]).routed_experts_BTX,
                           rows.routed_experts_BTX)
    assert collate(crafted_groups(0, 1), pad_id=0).routed_experts_BTX is None  # no trajectory carries any


def test_the_setting_asks_the_rollouts_for_routing():
    from megatron_tir.train.config import apply_overrides
    from megatron_tir.train.recipes import load_recipe

    cfg = apply_overrides(load_recipe("tiny-cpu"), ["engine.kind=sglang", "engine.urls=[http://127.0.0.1:9]",
                                                    "trainer.ppo.routing_replay=rollout"])
    assert cfg.rollout.routed_experts is True
    assert apply_overrides(load_recipe("tiny-cpu"), ["trainer.ppo.routing_replay=old_pass"]).rollout.routed_experts \
        is False
    with pytest.raises(ValueError, match="rollout.routed_experts is decided by trainer.ppo.routing_replay"):
        apply_overrides(load_recipe("tiny-cpu"), ["rollout.routed_experts=true"])


@pytest.mark.slow  # one tiny-cpu step against a fake server process (~60 s)
def test_one_step_replays_the_servers_routing(tmp_path):
    from megatron_tir.model_sources import resolve_model
    from megatron_tir.ports import free_port
    from megatron_tir.rollout.engines.sglang import SGLangServer, SGLangServerConfig

    model = str(resolve_model("tiny-qwen3-moe"))
    server = SGLangServer(SGLangServerConfig(model_path=model, port=free_port(), random_seed=0,
                                             enable_return_routed_experts=True,
                                             launcher=(sys.executable, str(FAKE_SERVER)),
                                             log_file=str(tmp_path / "server.log"))).start()
    try:
        server.wait_healthy(timeout_s=120, poll_s=0.2)
        run = tmp_path / "run"
        p = subprocess.run([sys.executable, "-m", "megatron_tir.cli", "train", "--recipe", "tiny-cpu",
                            "--set", f"model={model}", "--set", "engine.kind=sglang",
                            "--set", f"engine.urls={server.url}", "--set", "trainer.steps=1",
                            "--set", "data.eval_size=0", "--set", "trainer.progress=false",
                            "--set", "trainer.ppo.mini_batches=2", "--set", "learner.lr=0.05",
                            "--set", "trainer.ppo.routing_replay=rollout", "--out", str(run)],
                           env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                           capture_output=True, text=True, timeout=900, cwd=ROOT)
        assert p.returncode == 0, p.stderr[-3000:]
        with urllib.request.urlopen(f"{server.url}/fake_state", timeout=30) as response:
            state = json.loads(response.read())
    finally:
        server.stop()
    (line,) = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    print(f"rollout replay: routing/topk_changed_share {line['routing/topk_changed_share']:.4f}")
    assert line["train/optimizer_steps"] == 2
    # the first mini-batch ran on the weights the server sampled with (learner = transformers' routing), the
    # second on moved routers: some of their own top-k differ from the replayed rollout's
    assert 0 < line["routing/topk_changed_share"] < 1
    assert not state["contract_errors"] and "/generate" in state["paths"]

"""The planner counts what a run holds: the critic and the frozen reference, the colocated generation phase
(and refuses what start-up refuses), the steps one allocation completes, and sandbox slots from measured cells."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_tir.launch.cli import main
from megatron_tir.launch.cluster import load_cluster
from megatron_tir.launch.layout import train_config
from megatron_tir.launch.model_facts import model_spec
from megatron_tir.launch.plan import GIB, Assumptions, ModelShape, plan_run

REPO = Path(__file__).resolve().parents[2]


def _plan(recipe, cluster, overrides=(), **kw):
    return plan_run(train_config(recipe=recipe, overrides=list(overrides)), load_cluster(cluster), **kw)


def test_zerotir_peak_exceeds_simpletir_by_the_critics_bytes(example_cluster):
    """Both 7B recipes share the learner's layout (TP 4, DP 8 on 4 nodes, 32K-token micro-batches), so the
    ZeroTIR critic is the whole difference. By hand: the critic is the policy's GPTModel without the
    vocab-parallel output layer (V h / 4 per GPU) and with a Linear(h, 1) value head; per parameter bf16
    weights 2 B + fp32 gradients 4 B + Adam m, v and the fp32 main copy 12 B over DP 8 -> 7.5 B. The issue
    measured the critic at ~13 GB per GPU (12.4 GiB)."""
    simple = _plan("qwen2.5-7b-simpletir", example_cluster)
    zero = _plan("qwen2.5-7b-zerotir", example_cluster)
    m = ModelShape.of(model_spec("Qwen2.5-7B"))
    policy_params = m.total_params / 4  # TP 4, PP 1: every parameter but the (replicated) final norm is split
    critic_params = policy_params - m.vocab * m.hidden / 4 + m.hidden
    critic_bytes = critic_params * (2 + 4 + 12 / 8)
    (s,), (z,) = simple.stages, zero.stages
    assert z.critic_bytes == pytest.approx(critic_bytes, rel=1e-3)
    assert z.peak_bytes - s.peak_bytes == pytest.approx(critic_bytes, rel=1e-3)
    assert critic_bytes / GIB == pytest.approx(12.4, rel=0.03)
    assert s.critic_bytes == 0 and s.reference_bytes == 0 and z.reference_bytes == 0  # no KL term in either


def test_a_kl_term_adds_the_frozen_reference_as_parameters_only(example_cluster):
    base = _plan("qwen2.5-7b-simpletir", example_cluster).stages[0]
    kl = _plan("qwen2.5-7b-simpletir", example_cluster, ["trainer.loss.kl_coef=0.001"]).stages[0]
    assert kl.reference_bytes == pytest.approx(base.params * 2, rel=1e-6)  # bf16 weights, no grads, no optimizer
    assert kl.peak_bytes - base.peak_bytes == pytest.approx(kl.reference_bytes)


def test_an_entropy_bonus_costs_12_bytes_per_logit_element_more(example_cluster):
    """The diagnostic runs without autograd (one chunk of temporaries); a bonus keeps its graph
    (policy.losses; measured in test_plan_loss_memory.py)."""
    base = _plan("qwen2.5-7b-simpletir", example_cluster).stages[0]
    bonus = _plan("qwen2.5-7b-simpletir", example_cluster, ["trainer.loss.entropy_coef=0.001"]).stages[0]
    elems = 32768 * 152064 / 4
    assert bonus.logits_bytes - base.logits_bytes == pytest.approx(elems * 12 - (1 << 24) * 16, rel=1e-6)


def test_plan_refuses_multi_node_colocated(cluster_file):
    """Start-up refuses it: the colocated weight sync (CUDA IPC from rank 0) refuses servers off rank 0's node
    (rollout.sync.sglang.check_node_local), and tir-launch starts servers on every trainer node."""
    four = _plan("qwen2.5-7b-simpletir", cluster_file({"sglang.nodes": 0, "sglang.mem_fraction_static": 0.3}))
    assert any("colocated SGLang servers (sglang.nodes 0) on 4 trainer nodes" in p for p in four.problems)
    one = _plan("qwen2.5-7b-simpletir", cluster_file({"sglang.nodes": 0, "trainer.nodes": 1,
                                                       "sglang.mem_fraction_static": 0.3}))
    assert not [p for p in one.problems if "colocated" in p]


def test_colocated_generation_phase_counts_the_kept_weights_and_sglangs_share(cluster_file):
    """Generation: every rank keeps its weights (policy.memory offloads gradients and optimizer state), SGLang
    takes mem_fraction_static of the GPU. 7B TP 4: 1.904B parameters per GPU in bf16 = 3.55 GiB;
    + 0.3 x 80 GiB = 27.55 GiB. At 0.85 it is 71.55 GiB, under the 72 usable; at 0.9, 75.55: refused."""
    def plan(fraction):
        return _plan("qwen2.5-7b-simpletir", cluster_file({"sglang.nodes": 0, "trainer.nodes": 1,
                                                            "sglang.mem_fraction_static": fraction}))
    p = plan(0.3)
    assert p.generation_bytes / GIB == pytest.approx(3.55 + 24, abs=0.01)
    assert "colocated generation, per GPU: 27.5 GiB" in p.table()
    assert not [x for x in plan(0.85).problems if "colocated generation" in x]
    assert [x for x in plan(0.9).problems if x.startswith("colocated generation needs 75.5 GiB per GPU")]


def test_a_4_hour_allocation_for_a_step_longer_than_4_hours_is_refused(example_cluster):
    """The 32B SimpleTIR step at 1% MFU: training ~25x longer than at 25%, so one step is > 4 h."""
    plan = _plan("qwen2.5-32b-simpletir", example_cluster, assume=Assumptions(mfu=0.01))
    assert plan.step_s > 4 * 3600 and plan.wall_s == 4 * 3600
    assert plan.steps_per_allocation == 0
    assert [p for p in plan.time_problems if p.startswith("a 04:00:00 allocation cannot finish one step and one "
                                                          "checkpoint")]
    assert plan.refusals() and not plan.refusals(allow=True)
    assert "WARNING (--allow): a 04:00:00 allocation" in plan.table(allow=True)
    ok = _plan("qwen2.5-32b-simpletir", example_cluster)
    # the default 32B step: (4 h - 15 min start-up - 2 min checkpoint) / step
    assert ok.steps_per_allocation == int((4 * 3600 - 900 - 120) // ok.step_s) >= 1 and not ok.time_problems


def test_tir_launch_plan_and_launch_refuse_a_step_longer_than_the_allocation_unless_allowed(example_cluster, capsys):
    """Ten epochs make the 32B step longer than the 4-hour allocation: `plan` exits 2, `plan --allow` 0 with a
    warning; a Slurm dry run is refused the same way and goes through with --allow."""
    over = ["--set", "trainer.ppo.epochs=10"]
    args = ["--recipe", "qwen2.5-32b-simpletir", "--cluster", str(example_cluster), *over]
    assert main(["plan", *args]) == 2
    out = capsys.readouterr().out
    assert "REFUSED: a 04:00:00 allocation cannot finish one step and one checkpoint" in out
    assert "0 step(s) per allocation of 4.00 h" in out
    assert main(["plan", *args, "--allow"]) == 0
    assert "WARNING (--allow): a 04:00:00 allocation" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--executor", "slurm", "--dryrun"])
    assert exit_.value.code == 2
    assert "cannot finish one step and one checkpoint" in capsys.readouterr().err
    assert main([*args, "--executor", "slurm", "--dryrun", "--allow"]) == 0
    assert "#SBATCH" in capsys.readouterr().out


def test_the_planners_sandbox_latency_is_the_checked_in_measurement():
    """plan.Assumptions carries the mean and p90 of bench/data/tir_cells_latency.json (bench/bench_cells.py)."""
    record = json.loads((REPO / "bench" / "data" / "tir_cells_latency.json").read_text())
    a = Assumptions()
    assert a.sandbox_call_s == pytest.approx(record["overall"]["mean_s"], abs=5e-4)
    assert a.sandbox_call_p90_s == pytest.approx(record["overall"]["p90_s"], abs=5e-4)
    assert record["command"].startswith("python bench/bench_cells.py")
    cells = [json.loads(line) for line in (REPO / "bench" / "data" / "tir_cells.jsonl").read_text().splitlines()]
    assert set(record["cells"]) == {c["name"] for c in cells}
    assert record["overall"]["calls"] == sum(len(c["latencies_s"]) for c in record["cells"].values())


def test_sandbox_slots_follow_littles_law_at_the_measured_latency(example_cluster):
    """slots = ceil(max_in_flight x c / (c + turn time)): ten times the per-call latency needs more slots, and
    the figure is Little's law computed by hand from the plan's own turn time."""
    import math

    fast = _plan("qwen2.5-7b-simpletir", example_cluster, assume=Assumptions(sandbox_call_s=0.0115))
    slow = _plan("qwen2.5-7b-simpletir", example_cluster)
    assert fast.sandbox_slots_needed < slow.sandbox_slots_needed <= 1024
    cfg = train_config(recipe="qwen2.5-7b-simpletir")
    a = Assumptions()
    servers, params_b = 4, ModelShape.of(model_spec("Qwen2.5-7B")).total_params / 1e9
    per_seq_tps = servers * a.decode_k * 4 / params_b / cfg.rollout.max_in_flight
    turn_s = a.mean_response_share * cfg.rollout.max_response_tokens / cfg.rollout.max_turns / per_seq_tps
    c = a.sandbox_call_s
    assert slow.sandbox_slots_needed == math.ceil(cfg.rollout.max_in_flight * c / (c + turn_s))


def test_bench_cells_runs_cells_on_a_real_sandbox_cluster_and_writes_their_distribution(tmp_path):
    """bench/bench_cells.py end to end on a real LocalCluster: a sympy cell, an error and a time-out (1 s limit),
    each as the rollout runs it (final_answer prelude)."""
    import subprocess
    import sys

    cells = tmp_path / "cells.jsonl"
    cells.write_text("\n".join(json.dumps(c) for c in [
        {"name": "solve", "kind": "sympy", "code": "import sympy as sp\nx = sp.symbols('x')\n"
                                                   "final_answer(sum(sp.solve(x**2 - 5*x + 6, x)))"},
        {"name": "error", "kind": "error", "code": "print(1 / 0)"},
        {"name": "spin", "kind": "timeout", "code": "while True:\n    pass"}]) + "\n")
    out = tmp_path / "latency.json"
    done = subprocess.run([sys.executable, str(REPO / "bench" / "bench_cells.py"), "--cells", str(cells), "--repeats",
                           "2", "--workers", "1", "--timeout", "1", "--out", str(out)], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads(out.read_text())
    assert {n: set(c["statuses"]) for n, c in record["cells"].items()} == {"solve": {"OK"}, "error": {"ERROR"},
                                                                           "spin": {"TIMEOUT"}}
    assert all(0.95 <= t < 5 for t in record["cells"]["spin"]["latencies_s"])  # the 1 s limit, and the client's wait
    assert max(record["cells"]["solve"]["latencies_s"]) < 5 and record["overall"]["calls"] == 6
    every = sorted(t for c in record["cells"].values() for t in c["latencies_s"])
    assert record["overall"]["mean_s"] == pytest.approx(sum(every) / 6, abs=1e-3)
    assert record["overall"]["max_s"] == pytest.approx(every[-1], abs=1e-3)
    assert "all 6 calls: mean" in done.stdout

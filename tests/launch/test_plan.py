"""The capacity planner: DESIGN.md's cluster-scale estimates, its refusals, the shipped recipes, the CLI."""

from __future__ import annotations

import pytest

from megatron_tir.launch.cli import main
from megatron_tir.launch.cluster import load_cluster
from megatron_tir.launch.layout import train_config
from megatron_tir.launch.model_facts import model_spec
from megatron_tir.launch.plan import GIB, ModelShape, learner_stages, plan_run

RECIPES = ("qwen2.5-7b-simpletir", "qwen2.5-32b-simpletir")
NO_MEMORY_SAVING = ("learner.sequence_parallel=false", "learner.recompute_granularity=null",
                    "learner.recompute_method=null", "learner.recompute_num_layers=null")


def _peak(model, *, tp, pp, dp, tokens=32768, sp=False, recompute=None):
    stages = learner_stages(ModelShape.of(model_spec(model)), tp=tp, pp=pp, dp=dp, tokens=tokens, dtype="bfloat16",
                            sp=sp, recompute=recompute, distributed_optimizer=True)
    return [s.peak_bytes / GIB for s in stages], stages


def test_the_estimates_of_design_at_cluster_scale():
    """DESIGN.md "At cluster scale": 32B TP8 x PP2 x DP2 at 32K tokens ~149 GiB on stage 0, ~79 with sequence
    parallelism, ~45 with full recomputation; 2.05B parameters and ~23 GiB of static state per GPU; 7B TP4
    ~78.5 GiB at 32K, fits at 16K."""
    peaks, stages = _peak("Qwen2.5-32B", tp=8, pp=2, dp=2)
    assert stages[0].params / 1e9 == pytest.approx(2.05, abs=0.01)
    assert stages[0].static_bytes / GIB == pytest.approx(23, abs=0.5)
    assert stages[0].activation_bytes / GIB == pytest.approx(63, rel=0.02) and stages[0].in_flight == 2
    assert stages[1].logits_bytes / GIB == pytest.approx(7, rel=0.05)
    assert peaks[0] == pytest.approx(149, rel=0.02)
    assert _peak("Qwen2.5-32B", tp=8, pp=2, dp=2, sp=True)[0][0] == pytest.approx(79, rel=0.02)
    assert _peak("Qwen2.5-32B", tp=8, pp=2, dp=2, recompute="full")[0][0] == pytest.approx(45, rel=0.02)
    assert _peak("Qwen2.5-7B", tp=4, pp=1, dp=8)[0][0] == pytest.approx(78.5, rel=0.03)
    assert _peak("Qwen2.5-7B", tp=4, pp=1, dp=8, tokens=16384)[0][0] < 0.9 * 80


def test_parameter_counts_match_the_model_cards():
    # Qwen2.5 model cards: 7.61B parameters (7B), 32.5B (32B; the config's shapes give 32.76B)
    assert ModelShape.of(model_spec("Qwen2.5-7B")).total_params / 1e9 == pytest.approx(7.61, abs=0.01)
    assert ModelShape.of(model_spec("Qwen2.5-32B")).total_params / 1e9 == pytest.approx(32.5, rel=0.01)


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_shipped_recipes_fit_the_shipped_cluster_file(recipe, example_cluster):
    plan = plan_run(train_config(recipe=recipe), load_cluster(example_cluster))
    assert plan.problems == []
    assert max(s.peak_bytes for s in plan.stages) <= plan.usable_bytes
    assert plan.first_checkpoint_s < plan.wall_s and plan.server.kv_tokens > 24576


def test_refuses_qwen25_7b_at_sglang_tp_8(cluster_file):
    plan = plan_run(train_config(recipe="qwen2.5-7b-simpletir"), load_cluster(cluster_file({"sglang.tp": 8})))
    assert any("sglang.tp=8 does not divide the model's 28 attention heads" in p for p in plan.problems)
    plan = plan_run(train_config(recipe="qwen2.5-7b-simpletir", overrides=["learner.tp=8",
                                                                          "learner.sequence_parallel=false"]),
                    load_cluster(cluster_file()))
    assert any("learner.tp=8 does not divide the model's 28 attention heads" in p for p in plan.problems)


def test_refuses_32b_without_recomputation_on_80_gib(example_cluster):
    cluster = load_cluster(example_cluster)
    plan = plan_run(train_config(recipe="qwen2.5-32b-simpletir", overrides=NO_MEMORY_SAVING), cluster)
    assert any(p.startswith("trainer stage 0 needs 149.") for p in plan.problems)
    plan = plan_run(train_config(recipe="qwen2.5-32b-simpletir", overrides=NO_MEMORY_SAVING[1:] + (
        "learner.sequence_parallel=true",)), cluster)  # sequence parallelism alone: ~79 GiB
    assert any(p.startswith("trainer stage 0 needs 79.") for p in plan.problems)


def test_refuses_a_wall_time_shorter_than_the_first_checkpoint(example_cluster):
    plan = plan_run(train_config(recipe="qwen2.5-32b-simpletir", overrides=["trainer.checkpoint.minutes=0"]),
                    load_cluster(example_cluster))
    assert [p for p in plan.problems if "first checkpoint" in p]


def test_tir_launch_checks_the_plan_before_it_submits(example_cluster, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--recipe", "qwen2.5-32b-simpletir", "--executor", "slurm", "--cluster", str(example_cluster),
              "--dryrun", *(w for s in NO_MEMORY_SAVING for w in ("--set", s))])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"tir-launch: error: {example_cluster}: trainer stage 0 needs 149.")


def test_tir_launch_plan_prints_the_tables(example_cluster, capsys):
    assert main(["plan", "--recipe", "qwen2.5-32b-simpletir", "--cluster", str(example_cluster)]) == 0
    out = capsys.readouterr().out
    assert "trainer, per GPU (GiB)" in out and "sglang: 4 server(s) of TP 4" in out and out.rstrip().endswith("fits")
    assert main(["plan", "--recipe", "qwen2.5-32b-simpletir", "--cluster", str(example_cluster),
                 "--set", "trainer.checkpoint.minutes=0"]) == 2


@pytest.mark.parametrize("model,pp,tensors", [("Qwen2.5-7B", 1, 339), ("Qwen2.5-32B", 2, 771)])
def test_sync_time_follows_its_formula_over_the_learners_buckets(model, pp, tensors):
    """The planner's sync model: the bytes are ``2 P`` (the memory model's parameter count), the
    tensors the key map's HF tensors (771 for the 32B: 64 layers x 12 + embedding, norm, head),
    the buckets between bytes / (256 MiB + the largest tensor) and bytes / 256 MiB + one per stage; per-stage = wire at one link's speed + a round
    trip per bucket; through rank 0 adds the other stages' hop and a call per tensor."""
    from megatron_tir.launch.plan import Assumptions, sync_time

    spec, a = model_spec(model), Assumptions()
    got = sync_time(model, pp=pp)
    assert got["bytes"] == 2 * ModelShape.of(spec).total_params
    assert got["tensors"] == tensors
    largest = 2 * spec.vocab_size * spec.hidden_size  # a bucket closes once it holds 256 MiB: one tensor may overshoot
    assert got["bytes"] / (a.sync_bucket_bytes + largest) <= got["buckets"] <= got["bytes"] / a.sync_bucket_bytes + pp
    wire = got["bytes"] / a.sync_link_bytes_s
    assert got["per_stage_s"] == pytest.approx(wire + got["buckets"] * a.sync_call_s, abs=0.01)
    hop = 0.0 if pp == 1 else got["bytes"] / 2 / a.sync_link_bytes_s  # 32B at PP 2: about half on stage 1
    assert got["through_rank0_s"] == pytest.approx(hop + wire + got["buckets"] * a.sync_call_s
                                                   + tensors * a.sync_tensor_s, abs=0.05)
    assert got["per_stage_s"] < got["through_rank0_s"]

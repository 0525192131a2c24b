"""The capacity planner: DESIGN.md's cluster-scale estimates, its refusals, the shipped recipes, the CLI."""

from __future__ import annotations

import pytest

from megatron_tir.launch.cli import main
from megatron_tir.launch.cluster import load_cluster
from megatron_tir.launch.layout import train_config
from megatron_tir.launch.model_facts import model_spec
from megatron_tir.launch.plan import GIB, ModelShape, learner_stages, plan_run

RECIPES = ("qwen2.5-7b-simpletir", "qwen2.5-32b-simpletir", "qwen2.5-7b-zerotir")
NO_MEMORY_SAVING = ("learner.sequence_parallel=false", "learner.recompute_granularity=null",
                    "learner.recompute_method=null", "learner.recompute_num_layers=null")


def _peak(model, *, tp, pp, dp, tokens=32768, sp=False, recompute=None):
    stages = learner_stages(ModelShape.of(model_spec(model)), tp=tp, pp=pp, dp=dp, tokens=tokens, dtype="bfloat16",
                            sp=sp, recompute=recompute, distributed_optimizer=True, entropy="diagnostic")
    return [s.peak_bytes / GIB for s in stages], stages


def test_the_estimates_of_design_at_cluster_scale():
    """DESIGN.md "At cluster scale": 32B TP8 x PP2 x DP2 at 32K tokens ~149 GiB on stage 0, ~79 with sequence
    parallelism, ~45 with full recomputation; 2.05B parameters and ~23 GiB of static state per GPU; 7B TP4
    ~78.5 GiB at 32K, fits at 16K. DESIGN's logits + loss (~7 GiB at 32B, part of the 7B's 78.5) counted 12 bytes
    per bf16 logit element; measured on CPU the loss path keeps 8 (test_plan_loss_memory.py): 32768 x 152064 / 8
    x 8 B = 4.64 GiB at 32B TP 8, and 4.64 GiB less at 7B TP 4 (32768 x 38016 x 4 B); the entropy diagnostic adds
    one chunk of 2^24 elements x 16 B = 0.25 GiB."""
    peaks, stages = _peak("Qwen2.5-32B", tp=8, pp=2, dp=2)
    assert stages[0].params / 1e9 == pytest.approx(2.05, abs=0.01)
    assert stages[0].static_bytes / GIB == pytest.approx(23, abs=0.5)
    assert stages[0].activation_bytes / GIB == pytest.approx(63, rel=0.02) and stages[0].in_flight == 2
    assert stages[1].logits_bytes / GIB == pytest.approx(4.64 + 0.25, rel=0.01)
    assert peaks[0] == pytest.approx(149, rel=0.02)
    assert _peak("Qwen2.5-32B", tp=8, pp=2, dp=2, sp=True)[0][0] == pytest.approx(79, rel=0.02)
    assert _peak("Qwen2.5-32B", tp=8, pp=2, dp=2, recompute="full")[0][0] == pytest.approx(45, rel=0.02)
    assert _peak("Qwen2.5-7B", tp=4, pp=1, dp=8)[0][0] == pytest.approx(78.5 - 4.64 + 0.25, rel=0.03)
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
    assert [p for p in plan.time_problems if "first checkpoint" in p] and not plan.problems


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
def test_sync_time_counts_the_learners_bytes_and_tensors(model, pp, tensors):
    """The bytes are ``2 P`` (the memory model's parameter count), the tensors the key map's HF
    tensors (771 for the 32B: 64 layers x 12 + embedding, norm, head), the buckets between
    bytes / (256 MiB + the largest tensor) and bytes / 256 MiB + one per stage; the per-stage
    scheme is faster than through rank 0 at the default assumptions."""
    from megatron_tir.launch.plan import Assumptions, sync_time

    spec, a = model_spec(model), Assumptions()
    got = sync_time(model, pp=pp)
    assert got["bytes"] == 2 * ModelShape.of(spec).total_params
    assert got["tensors"] == tensors
    largest = 2 * spec.vocab_size * spec.hidden_size  # a bucket closes once it holds 256 MiB: one tensor may overshoot
    assert got["bytes"] / (a.sync_bucket_bytes + largest) <= got["buckets"] <= got["bytes"] / a.sync_bucket_bytes + pp
    assert got["per_stage_s"] < got["through_rank0_s"]


TINY = dict(family="qwen2", vocab_size=16, hidden_size=8, num_layers=2, num_attention_heads=2, num_query_groups=1,
            head_dim=4, ffn_hidden_size=16, max_position_embeddings=32, rotary_base=1e4, norm_epsilon=1e-6,
            qkv_bias=True, tie_word_embeddings=False, dtype="bfloat16")


def test_sync_time_of_a_tiny_model_by_hand():
    """Counted by hand. A Qwen2 layer of hidden 8, 2 heads of 4, 1 KV head, FFN 16 has 12 HF tensors:
    2 norms (8 each), q (8x8 + 8), k and v (4x8 + 4 each), o (8x8), gate, up, down (16x8 each):
    608 parameters; embedding and head 16x8 = 128 each, final norm 8. PP 1: 2 x 608 + 264 = 1480
    parameters, 2960 bytes, 27 tensors; PP 2: stage 0 = embedding + layer 0 = 736 (1472 B),
    stage 1 = layer 1 + norm + head = 744 (1488 B). One bucket a stage (1 MiB buckets); at
    1000 B/s, 0.5 s a bucket's round trip, 0.01 s a tensor's call:
    per stage   PP 1: 2.96 + 0.5 = 3.46 s;    PP 2: 2.96 + 2 x 0.5 = 3.96 s (the servers take one bucket at a time)
    via rank 0  PP 1: 3.46 + 27 x 0.01 = 3.73 s;  PP 2: 1.488 (stage 1's hop) + 3.96 + 0.27 = 5.718 s."""
    from megatron_tir.launch.plan import Assumptions, sync_time
    from megatron_tir.policy.spec import ModelSpec

    spec = ModelSpec(**TINY)
    a = Assumptions(sync_link_bytes_s=1000.0, sync_call_s=0.5, sync_tensor_s=0.01, sync_bucket_bytes=1 << 20)
    one, two = sync_time(spec, pp=1, assume=a), sync_time(spec, pp=2, assume=a)
    assert (one["bytes"], one["tensors"], one["buckets"]) == (2960, 27, 1)
    assert (two["bytes"], two["tensors"], two["buckets"]) == (2960, 27, 2)
    assert (one["per_stage_s"], one["through_rank0_s"]) == (3.46, 3.73)
    assert (two["per_stage_s"], two["through_rank0_s"]) == (3.96, 5.72)


def test_sync_time_scales_with_bytes_over_bandwidth():
    """Limits: with free calls the time is the bytes over the bandwidth (halving it doubles the
    time; a model twice as wide is ~4x the bytes and ~4x the time); through rank 0 at PP 2 is
    longer than per stage by about the hop of stage 1's bytes; at PP 1 they differ only by the
    per-tensor calls."""
    import dataclasses

    from megatron_tir.launch.plan import Assumptions, sync_time
    from megatron_tir.policy.spec import ModelSpec

    free = Assumptions(sync_link_bytes_s=1e3, sync_call_s=0.0, sync_tensor_s=0.0, sync_bucket_bytes=64)
    spec = ModelSpec(**TINY)
    base = sync_time(spec, pp=1, assume=free)
    slow = sync_time(spec, pp=1, assume=dataclasses.replace(free, sync_link_bytes_s=500.0))
    assert slow["per_stage_s"] == pytest.approx(2 * base["per_stage_s"], abs=0.01)
    assert base["through_rank0_s"] == base["per_stage_s"]
    wide = sync_time(ModelSpec(**{**TINY, "hidden_size": 16, "head_dim": 8, "ffn_hidden_size": 32}), pp=1, assume=free)
    assert wide["bytes"] / base["bytes"] == pytest.approx(wide["per_stage_s"] / base["per_stage_s"], rel=0.01)
    assert 3.5 < wide["bytes"] / base["bytes"] < 4
    two = sync_time(spec, pp=2, assume=free)
    assert two["per_stage_s"] == base["per_stage_s"]  # the same bytes on one link at a time
    assert two["through_rank0_s"] == pytest.approx(two["per_stage_s"] + 1488 / 1e3, abs=0.01)

"""SGLang's MoE server arguments (expert parallelism, routed-experts capture): every flag built is one
SGLang 0.5.23 declares (its ``srt/arg_groups/fields``, read by ``sglang_schema.server_cli_flags``), the
expert-parallel size divides the server's TP as SGLang's ``moe_tp_size = tp_size // ep_size`` needs,
and a cluster file's ``sglang.ep`` reaches every server's command line."""

from __future__ import annotations

from pathlib import Path

import pytest
from sglang_schema import server_cli_flags

from megatron_tir.rollout.engines.base import ServerPlan
from megatron_tir.rollout.engines.sglang import SGLangServerConfig
from megatron_tir.rollout.engines.sglang.kind import SGLANG

ROOT = Path(__file__).resolve().parents[4]


def _flags(argv: list[str]) -> set[str]:
    return {a for a in argv if a.startswith("--")}


def test_moe_flags_are_declared_by_sglang():
    argv = SGLangServerConfig(model_path="/models/Qwen3-30B-A3B", tp_size=4, ep_size=4,
                              enable_return_routed_experts=True).argv()
    assert {"--ep-size", "--enable-return-routed-experts"} <= _flags(argv) <= server_cli_flags()
    assert argv[argv.index("--ep-size") + 1] == "4"
    plain = SGLangServerConfig(model_path="/m", tp_size=4).argv()  # SGLang's defaults: not spelled out
    assert "--ep-size" not in plain and "--enable-return-routed-experts" not in plain


@pytest.mark.parametrize("tp,ep", [(4, 3), (2, 4), (4, 0)])
def test_ep_must_divide_the_servers_tp(tp, ep):
    with pytest.raises(ValueError, match=f"ep_size must divide tp_size={tp}"):
        SGLangServerConfig(model_path="/m", tp_size=tp, ep_size=ep)


def test_the_kind_renders_each_servers_ep():
    plan = ServerPlan(model_path="/m", host="0.0.0.0", first_port=30000, count=2, tp=4, mem_fraction_static=0.85,
                      colocated=False, python="python", ep=2)
    for _, argv in SGLANG.servers(plan):
        assert argv[argv.index("--ep-size") + 1] == "2" and argv[argv.index("--tp-size") + 1] == "4"


def test_a_cluster_files_sglang_ep_reaches_the_servers():
    import yaml

    from megatron_tir.launch.cluster import cluster_from_dict
    from megatron_tir.launch.slurm import sglang_services

    data = yaml.safe_load((ROOT / "launch" / "examples" / "h100.yaml").read_text())
    data["sglang"] = {"nodes": 1, "tp": 4, "ep": 4}
    services = sglang_services(cluster_from_dict(data, where="c.yaml"), "Qwen3-30B-A3B")
    assert len(services) == 2 and all("--ep-size 4" in s for s in services)
    with pytest.raises(ValueError, match=r"ep must be >= 1 and divide tp \(4\), got 3"):
        cluster_from_dict(data | {"sglang": {"nodes": 1, "tp": 4, "ep": 3}}, where="c.yaml")


def test_a_run_that_replays_the_rollouts_routing_launches_servers_that_capture_it():
    import yaml

    from megatron_tir.launch.cluster import cluster_from_dict
    from megatron_tir.launch.layout import trainer_layout
    from megatron_tir.launch.slurm import sglang_services

    sglang = ["engine.kind=sglang", "engine.urls=[http://127.0.0.1:9]"]
    layout = trainer_layout(recipe="tiny-cpu", overrides=[*sglang, "trainer.ppo.routing_replay=rollout"])
    assert layout.routed_experts and not trainer_layout(recipe="tiny-cpu", overrides=sglang).routed_experts
    cluster = cluster_from_dict(yaml.safe_load((ROOT / "launch" / "examples" / "h100.yaml").read_text()), where="c")
    on = sglang_services(cluster, "Qwen3-30B-A3B", routed_experts=layout.routed_experts)
    assert on and all("--enable-return-routed-experts" in s for s in on)
    assert not any("--enable-return-routed-experts" in s for s in sglang_services(cluster, "Qwen3-30B-A3B"))

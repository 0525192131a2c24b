"""The cluster file: the example loads, and each kind of mistake is one line naming the key."""

from __future__ import annotations

import pytest

from megatron_tir.launch.cli import main
from megatron_tir.launch.cluster import check_layout, load_cluster
from megatron_tir.launch.layout import TrainerLayout, trainer_layout


def test_example_cluster_file_loads_with_its_layout(example_cluster):
    cluster = load_cluster(example_cluster)
    assert (cluster.trainer.nodes, cluster.sglang.nodes, cluster.sandbox.nodes) == (4, 2, 1)
    assert cluster.sandbox_apart and cluster.partition_of("sandbox") == "cpu"  # a second allocation of CPU nodes
    assert cluster.total_nodes == 6  # the main allocation: trainer and SGLang
    assert cluster.env["NCCL_SOCKET_IFNAME"] == cluster.env["GLOO_SOCKET_IFNAME"] == "ib0"
    assert cluster.node.gpus_per_node == 8 and cluster.servers_per_node == 2  # TP 4: divides 28 and 40 heads
    assert cluster.model_path("Qwen2.5-32B").endswith("/models/Qwen2.5-32B")
    assert cluster.model_path("unmapped") == "unmapped"
    check_layout(cluster, trainer_layout(recipe="qwen2.5-32b-simpletir"))  # TP 8 x PP 2 on 32 GPUs


def _layout(tp: int, pp: int) -> TrainerLayout:
    return TrainerLayout(model="m", tp=tp, pp=pp, sandbox_workers=1)


@pytest.mark.parametrize("changes, fragment", [
    ({"account": None}, "account: missing"),
    ({"trainer.nodes": None}, "trainer.nodes: missing"),
    ({"sandbox.workers": 3}, "sandbox.workers: unknown key"),
    ({"trainer.nodes": "four"}, "trainer.nodes: expected int"),
    ({"trainer.nodes": 0}, "trainer: nodes must be >= 1"),
    ({"mounts": ["/no/colon"]}, "mounts: '/no/colon' is not src:dst"),
    ({"sandbox.mounts": ["/no/colon"]}, "sandbox.mounts: '/no/colon' is not src:dst"),
    ({"partition": "gpu"}, "trainer.partition: 'gpu' is not in partitions"),
    ({"trainer.partition": "cpu"}, "trainer.partition: 'cpu' has no GPUs"),
    ({"partitions.gpu2": {"gpus_per_node": 8, "cpus_per_node": 224}, "sglang.partition": "gpu2"},
     "sglang.partition: 'gpu2' differs from the trainer's 'batch'"),
    ({"partitions.batch": {"gpus_per_node": 8, "cpus_per_node": 224, "gpu_only": True}, "sandbox.partition": "batch"},
     "sandbox.partition: 'batch' is GPU-only"),
    ({"sandbox.start_timeout_s": 5}, "sandbox: start_timeout_s must be >= 60"),
    ({"sglang.port": 80}, "sglang: port must be in 1024..64999"),
    ({"sglang.container_image": "img", "container_image": "__null__"},
     "sglang.container_image needs a cluster container_image"),
])
def test_bad_cluster_files_are_one_line_errors(cluster_file, changes, fragment):
    with pytest.raises(ValueError) as err:
        load_cluster(cluster_file(changes))
    message = str(err.value)
    assert fragment in message and "\n" not in message
    assert message.startswith("cluster file ")


def test_gpu_only_partition_takes_the_sandbox_beside_the_trainer(cluster_file):
    cluster = load_cluster(cluster_file({
        "partitions.batch": {"gpus_per_node": 8, "cpus_per_node": 224, "gpu_only": True}, "sandbox.nodes": 0}))
    assert cluster.total_nodes == 6


def test_unreadable_and_invalid_yaml(tmp_path):
    with pytest.raises(ValueError, match="No such file"):
        load_cluster(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("account: [unclosed\n")
    with pytest.raises(ValueError, match=r"not valid YAML \(line"):
        load_cluster(bad)


@pytest.mark.parametrize("layout, changes, fragment", [
    ((8, 3), {}, "TP x PP = 8 x 3 = 24 does not divide the trainer's 4 nodes x 8 GPUs = 32"),
    ((8, 2), {"trainer.nodes": 3}, "TP x PP = 8 x 2 = 16 does not divide the trainer's 3 nodes x 8 GPUs = 24"),
    ((16, 1), {}, "TP = 16 must divide the 8 GPUs of a node"),
    ((1, 1), {"sglang.tp": 3}, "sglang.tp = 3 must divide the 8 GPUs of a node"),
    ((1, 1), {"sandbox.workers_per_node": 500}, "sandbox.workers_per_node = 500 exceeds the 192 CPUs"),  # cpu's
    ((1, 1), {"sandbox.workers_per_node": 200}, "sandbox.workers_per_node = 200 exceeds the 192 CPUs"),
    ((1, 1), {"sandbox.workers_per_node": 300, "sandbox.nodes": 0}, "workers_per_node = 300 exceeds the 224 CPUs"),
])
def test_layout_contradictions(cluster_file, layout, changes, fragment):
    path = cluster_file(changes)
    with pytest.raises(ValueError, match="^" + str(path).replace(".", r"\.")) as err:
        check_layout(load_cluster(path), _layout(*layout), where=str(path))
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_colocated_on_several_trainer_nodes_is_refused_before_queueing(cluster_file, capsys):
    """Start-up would refuse it (the colocated weight sync reaches only rank 0's node): the layout check says so,
    also for a model whose shape the planner does not know."""
    path = cluster_file({"sglang.nodes": 0})
    with pytest.raises(ValueError, match="colocated SGLang servers \\(sglang.nodes 0\\) on 4 trainer nodes"):
        check_layout(load_cluster(path), _layout(4, 1), where=str(path))
    check_layout(load_cluster(cluster_file({"sglang.nodes": 0, "trainer.nodes": 1}, name="one.yaml")), _layout(4, 1))
    with pytest.raises(SystemExit) as exit_:
        main(["--recipe", "qwen2.5-7b-simpletir", "--executor", "slurm", "--cluster", str(path), "--dryrun"])
    assert exit_.value.code == 2
    assert "on 4 trainer nodes: the colocated weight sync" in capsys.readouterr().err.strip().splitlines()[-1]


def test_cli_reports_a_bad_cluster_file_in_one_line_and_exits_2(cluster_file, capsys):
    path = cluster_file({"trainer.nodes": 3})
    with pytest.raises(SystemExit) as exit_:
        main(["--recipe", "qwen2.5-32b-simpletir", "--executor", "slurm", "--cluster", str(path), "--dryrun"])
    assert exit_.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == (f"tir-launch: error: {path}: TP x PP = 8 x 2 = 16 does not divide the trainer's "
                    "3 nodes x 8 GPUs = 24")


@pytest.mark.parametrize("argv, fragment", [
    (["--recipe", "nope", "--executor", "local"], "unknown recipe 'nope'"),
    (["--recipe", "tiny-cpu", "--executor", "local", "--set", "trainer.nope=1"], "unknown key 'trainer.nope'"),
    (["--recipe", "tiny-cpu", "--executor", "slurm"], "--executor slurm needs --cluster FILE"),
    (["--recipe", "qwen2.5-32b-simpletir", "--executor", "local"], "needs TP x PP = 16 GPUs"),
    (["--executor", "local"], "give --recipe NAME"),
])
def test_cli_user_errors(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--dryrun"])
    assert exit_.value.code == 2
    assert fragment in capsys.readouterr().err.strip().splitlines()[-1]

"""One GPU node without Slurm: ``tir-launch --executor local`` with a GPU recipe on a node of 8 faked GPUs
(``CUDA_VISIBLE_DEVICES``, as CUDA sees them) renders the SGLang servers, the trainer and the sandbox with their
GPUs; the node is checked as a cluster file is (layout and capacity plan), every refusal one line."""

from __future__ import annotations

import shlex

import pytest

from megatron_tir.launch.cli import main
from megatron_tir.launch.gpu_node import GpuNode, detect_gpus, node_layout

EIGHT = ",".join(str(i) for i in range(8))
SMALLER_MICROBATCH = ("--set", "learner.max_tokens_per_microbatch=16384")


@pytest.fixture
def eight_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", EIGHT)
    monkeypatch.setattr("megatron_tir.launch.gpu_node._nvidia_smi_memory", lambda: [])  # 80 GiB assumed


def _dryrun(capsys, tmp_path, *args: str) -> tuple[int, str, str]:
    code = main(["--recipe", "qwen2.5-7b-simpletir", "--executor", "local", "--out", str(tmp_path / "run"),
                 "--dryrun", *args])
    out, err = capsys.readouterr()
    return code, out, err


def _agent(script: str) -> tuple[list[str], list[str]]:
    line = script[script.index("exec ") + 5:]
    agent, _, train = line.partition(" \\\n    -- ")
    return shlex.split(agent), shlex.split(train)


def test_split_node_servers_trainer_and_sandbox_with_their_gpus(eight_gpus, capsys, tmp_path):
    code, script, _ = _dryrun(capsys, tmp_path, *SMALLER_MICROBATCH)
    assert code == 0
    agent, train = _agent(script)
    services = dict(agent[i + 1].split("=", 1) for i, a in enumerate(agent) if a == "--service")
    assert sorted(services) == ["sandbox", "sglang-30000"]
    server = shlex.split(services["sglang-30000"])
    assert server[:2] == ["env", "CUDA_VISIBLE_DEVICES=0,1,2,3"] and server[3:5] == ["-m", "sglang.launch_server"]
    assert server[server.index("--tp-size") + 1] == "4" and server[server.index("--base-gpu-id") + 1] == "0"
    assert "--enable-memory-saver" not in server  # its own GPUs
    assert shlex.split(services["sandbox"])[1:4] == ["-m", "sandbox_cluster.cli", "serve"]
    assert agent[agent.index("--wait-http") + 1] == "http://127.0.0.1:30000"
    assert train[:2] == ["env", "CUDA_VISIBLE_DEVICES=4,5,6,7"]
    assert train[3:7] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    sets = [train[i + 1] for i, a in enumerate(train) if a == "--set"]
    assert sets == ["learner.max_tokens_per_microbatch=16384", "engine.kind=sglang",
                    "engine.urls=http://127.0.0.1:30000", "engine.colocated=false", "sandbox.address=tcp://127.0.0.1:5555"]


def test_colocated_servers_share_all_eight_gpus(eight_gpus, capsys, tmp_path):
    code, script, _ = _dryrun(capsys, tmp_path, "--sglang-gpus", "0")
    assert code == 0
    agent, train = _agent(script)
    servers = [shlex.split(agent[i + 1].split("=", 1)[1]) for i, a in enumerate(agent)
               if a == "--service" and agent[i + 1].startswith("sglang-")]
    assert [s[s.index("--base-gpu-id") + 1] for s in servers] == ["0", "4"]  # two TP-4 servers
    assert all(s[1] == f"CUDA_VISIBLE_DEVICES={EIGHT}" and "--enable-memory-saver" in s for s in servers)
    assert train[1] == f"CUDA_VISIBLE_DEVICES={EIGHT}" and "--nproc-per-node=8" in train
    assert "engine.colocated=true" in train


def test_the_node_is_checked_like_a_cluster_file(eight_gpus, capsys, tmp_path):
    code, _, err = _dryrun(capsys, tmp_path)  # 32K-token micro-batches on TP 4 x DP 1: the planner refuses
    assert code == 2 and err.startswith("tir-launch: error: this node (8 GPUs: 4 for SGLang, 4 for the trainer): "
                                        "trainer stage 0 needs ") and len(err.strip().splitlines()) == 1
    code, _, err = _dryrun(capsys, tmp_path, "--sglang-gpus", "3")
    assert code == 2 and "split in two equal halves" in err
    code, _, err = _dryrun(capsys, tmp_path, "--sglang-gpus", "0", "--set", "trainer.async=one_step")
    assert code == 2 and "cannot overlap with engine.colocated=true" in err


def test_no_gpus_and_cpu_recipes(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(SystemExit) as exit_:
        _dryrun(capsys, tmp_path, *SMALLER_MICROBATCH)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "recipe qwen2.5-7b-simpletir needs TP x PP = 4 GPUs" in err
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", EIGHT)  # a CPU recipe on a GPU node: the in-process engine as before
    assert main(["--recipe", "tiny-cpu", "--executor", "local", "--out", str(tmp_path / "t"), "--dryrun"]) == 0
    assert "sglang" not in capsys.readouterr().out


def test_detection_and_split():
    assert detect_gpus({"CUDA_VISIBLE_DEVICES": "-1"}) is None
    node = detect_gpus({"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b"})
    assert node is not None and node.devices == ("GPU-a", "GPU-b")
    layout = node_layout(GpuNode(devices=tuple(EIGHT.split(",")), memory_gib=80.0, cpus=64), tp=2, pp=1,
                         sglang_gpus=None, sglang_tp=None, sandbox_workers=128)
    assert layout.sglang_devices == ("0", "1", "2", "3") and layout.servers == 2  # TP 2: two servers on four GPUs
    assert layout.cluster.sandbox.workers_per_node == 64  # no more workers than CPUs
    three = node_layout(GpuNode(devices=("0", "1", "2"), memory_gib=80.0, cpus=8), tp=1, pp=1, sglang_gpus=None,
                        sglang_tp=None, sandbox_workers=2)
    assert three.colocated and three.trainer_devices == ("0", "1", "2") and three.servers == 3

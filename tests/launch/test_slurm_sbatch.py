"""The sbatch script for qwen2.5-32b-simpletir on the example H100 cluster, as nemo-run renders it.

The setup block and the groups' scripts are run by bash here, with stand-ins for the two
programs they call (``scontrol`` prints the allocation's host names, ``python`` records its
argv), so the addresses and command lines are checked after bash has expanded them.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import stat
import subprocess
from pathlib import Path

import pytest

from megatron_tir.launch.agent import parse_service
from megatron_tir.launch.cli import main
from megatron_tir.launch.cluster import load_cluster
from megatron_tir.launch.layout import trainer_layout
from megatron_tir.launch.slurm import render
from megatron_tir.launch.spec import LaunchRecord, RunSpec, write_record
from megatron_tir.train.config import apply_overrides, to_dict
from megatron_tir.train.recipes import load_recipe

RECIPE = "qwen2.5-32b-simpletir"
HOSTS = [f"gpu{i:03d}" for i in range(1, 8)]
# The example file runs the sandbox in a second allocation on its CPU partition (test_slurm_sandbox_job.py);
# these tests read the one-allocation layout, the sandbox on a node of the GPU partition.
ONE = {"sandbox.partition": "batch"}


def _render(cluster_path, run_dir, **spec):
    return render(load_cluster(cluster_path), RunSpec(recipe=RECIPE, layout=trainer_layout(recipe=RECIPE),
                                                      run_dir=str(run_dir), **spec))


def _sbatch_flags(sbatch: str) -> dict[str, str]:
    flags = {}
    for line in sbatch.splitlines():
        if line.startswith("#SBATCH --"):
            key, _, value = line[len("#SBATCH --"):].partition("=")
            flags[key] = value
    return flags


def _srun_lines(sbatch: str) -> list[str]:
    return [line for line in sbatch.splitlines() if line.startswith("srun ")]


def _setup_block(sbatch: str) -> str:
    start = sbatch.index("# tir-launch: one allocation")
    return sbatch[start:sbatch.index("# Command 1", start)]


@pytest.fixture
def shims(tmp_path):
    """A bin dir with ``scontrol`` (prints $SLURM_JOB_NODELIST one host a line) and ``python``
    (appends its argv, NUL-separated, to $ARGV_OUT)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text('#!/bin/bash\n[ "$1 $2" = "show hostnames" ] && tr , "\\n" <<< "$3"\n')
    (bin_dir / "python").write_text('#!/bin/bash\nprintf "%s\\0" "$@" > "$ARGV_OUT"\n')
    for f in bin_dir.iterdir():
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
    return bin_dir


def _bash(script: str, shims: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    full_env = {"PATH": f"{shims}:{os.environ['PATH']}", "HOME": os.environ.get("HOME", "/tmp"), **env}
    return subprocess.run(["bash", "-c", script], env=full_env, capture_output=True, text=True, timeout=60)


def _addresses(sbatch: str, shims: Path, hosts: list[str]) -> dict[str, str]:
    """The TIR_* variables the setup block exports for an allocation of ``hosts``."""
    out = shims / "env"
    result = _bash(_setup_block(sbatch) + '\nenv -0 > "$ENV_OUT"', shims,
                   {"SLURM_JOB_NODELIST": ",".join(hosts), "ENV_OUT": str(out)})
    assert result.returncode == 0, result.stderr
    pairs = (item.partition("=") for item in out.read_text().split("\0") if item.startswith("TIR_"))
    return {k: v for k, _, v in pairs}


def _agent_argv(script: str, shims: Path, tmp_path: Path, env: dict[str, str]) -> list[str]:
    out = tmp_path / "argv"
    out.unlink(missing_ok=True)
    result = _bash(script, shims, {**env, "ARGV_OUT": str(out), "SLURM_JOB_ID": "4242"})
    assert result.returncode == 0, result.stderr
    return out.read_text().split("\0")[:-1]


def _options(argv: list[str], name: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == name]


# ----------------------------------------------------------------------------- the 32B layout


@pytest.fixture
def rendered(cluster_file, tmp_path):
    # the example file runs two TP-4 servers per node (for Qwen2.5-7B's 28 heads too); these tests read
    # the one-TP-8-server-per-node layout, valid for the 32B recipe's 40 heads
    return _render(cluster_file({"sglang.tp": 8, **ONE}), tmp_path / "runs" / "q32")


def test_one_allocation_of_all_groups(rendered):
    flags = _sbatch_flags(rendered.sbatch)
    assert flags["nodes"] == "7" and flags["gpus-per-node"] == "8" and flags["ntasks-per-node"] == "1"
    assert (flags["partition"], flags["account"], flags["time"], flags["qos"]) == ("batch", "my_account",
                                                                                  "04:00:00", "normal")
    assert "exclusive" in flags and flags["mem"] == "0"
    assert "hetjob" not in rendered.sbatch and "--het-group" not in rendered.sbatch
    assert "None" not in rendered.sbatch  # nemo-run renders a missing gpus_per_node as "None" in het jobs


def test_srun_lines_pin_each_group_to_its_nodes(rendered, example_cluster):
    lines = _srun_lines(rendered.sbatch)
    assert list(rendered.scripts) == ["sandbox", "sglang", "trainer"] and len(lines) == 3
    for line, group, nodes in zip(lines, ["sandbox", "sglang", "trainer"], [1, 2, 4], strict=True):
        words = line.split()
        assert f"--nodes={nodes}" in words and f"--ntasks={nodes}" in words and "--ntasks-per-node=1" in words
        assert f"--nodelist=$TIR_{group.upper()}_NODES" in words
        assert "--cpus-per-task=224" in words
        assert words[words.index("--container-image") + 1] == load_cluster(example_cluster).container_image
        assert words[-4:-2] == ["bash", f"/nemo_run/scripts/{rendered.script_names[group]}"]
        assert line.endswith(f"& pids[{lines.index(line)}]=$!")  # all groups run at once, watched together
    assert "--gres=gpu:0" in lines[0].split() and "--gres=gpu:0" not in lines[2].split()
    mounts = lines[2].split()[lines[2].split().index("--container-mounts") + 1].split(",")
    assert "/lustre/fsw/my_project:/lustre/fsw/my_project" in mounts


def test_addresses_come_from_the_allocations_host_names(rendered, shims, tmp_path):
    env = _addresses(rendered.sbatch, shims, HOSTS)
    assert env["TIR_TRAINER_NODES"] == "gpu001,gpu002,gpu003,gpu004"
    assert env["TIR_SGLANG_NODES"] == "gpu005,gpu006"
    assert env["TIR_SANDBOX_NODES"] == "gpu007"
    assert env["TIR_MASTER_ADDR"] == "gpu001"
    assert env["TIR_ENGINE_URLS"] == "http://gpu005:30000,http://gpu006:30000"
    assert env["TIR_SANDBOX_ADDRESS"] == "tcp://gpu007:5555"
    assert env["TIR_SANDBOX_WORKER_ADDRESS"] == "tcp://gpu007:5556"
    assert env["TIR_RUN_DIR"] == str(tmp_path / "runs" / "q32") and (tmp_path / "runs" / "q32" / "logs").is_dir()


def test_setup_fails_on_an_allocation_of_the_wrong_size(rendered, shims):
    result = _bash(_setup_block(rendered.sbatch), shims, {"SLURM_JOB_NODELIST": ",".join(HOSTS[:6])})
    assert result.returncode == 1 and "tir-launch: expected 7 nodes, got 6" in result.stderr


def test_trainer_torchrun_and_the_addresses_it_is_given(rendered, shims, tmp_path):
    env = _addresses(rendered.sbatch, shims, HOSTS)
    argv = _agent_argv(rendered.scripts["trainer"], shims, tmp_path, {**env, "SLURM_PROCID": "0"})
    assert argv[:2] == ["-m", "megatron_tir.launch.agent"]
    assert _options(argv, "--wait-http") == ["http://gpu005:30000,http://gpu006:30000"]
    assert _options(argv, "--wait-tcp") == ["tcp://gpu007:5555"]
    assert _options(argv, "--service") == []  # servers and sandbox have their own nodes
    main_cmd = argv[argv.index("--") + 1:]
    cut = main_cmd.index("-m")
    assert main_cmd[:cut] == ["torchrun", "--nnodes=4", "--nproc-per-node=8", "--rdzv-backend=c10d",
                              "--rdzv-endpoint=gpu001:29500", "--rdzv-id=4242", "--max-restarts=0"]
    train = main_cmd[cut:]
    assert train[:7] == ["-m", "megatron_tir.cli", "train", "--recipe", RECIPE, "--out", env["TIR_RUN_DIR"]]
    sets = _options(train, "--set")
    assert sets == ["model=/lustre/fsw/my_project/models/Qwen2.5-32B", "learner.tp=8", "learner.pp=2",
                    "engine.kind=sglang", "engine.urls=http://gpu005:30000,http://gpu006:30000",
                    "engine.colocated=false", "sandbox.address=tcp://gpu007:5555"]
    # The trainer's own config accepts them and gets the addresses.
    cfg = apply_overrides(load_recipe(RECIPE), sets)
    assert cfg.engine.urls == ("http://gpu005:30000", "http://gpu006:30000")
    assert cfg.sandbox.address == "tcp://gpu007:5555" and (cfg.learner.tp, cfg.learner.pp) == (8, 2)
    assert "TP 8 x PP 2 x DP 2" in rendered.scripts["trainer"]  # 4 x 8 GPUs / (8 x 2)


def test_sglang_servers_one_per_node(rendered, shims, tmp_path):
    env = _addresses(rendered.sbatch, shims, HOSTS)
    argv = _agent_argv(rendered.scripts["sglang"], shims, tmp_path, {**env, "SLURM_PROCID": "1"})
    assert "--" not in argv  # services only: they run until the job ends
    (service,) = _options(argv, "--service")
    name, cmd = parse_service(service)
    assert name == "sglang-30000"
    assert cmd[:3] == ["python", "-m", "sglang.launch_server"]
    opts = dict(zip(cmd[3::2], cmd[4::2], strict=False))
    assert opts["--model-path"] == "/lustre/fsw/my_project/models/Qwen2.5-32B"
    assert (opts["--host"], opts["--port"], opts["--tp-size"], opts["--base-gpu-id"]) == ("0.0.0.0", "30000", "8", "0")
    assert "--enable-memory-saver" not in cmd


def test_sandbox_broker_on_the_first_node_workers_on_every_node(rendered, shims, tmp_path):
    env = _addresses(rendered.sbatch, shims, HOSTS)
    head = dict(parse_service(s) for s in _options(
        _agent_argv(rendered.scripts["sandbox"], shims, tmp_path, {**env, "SLURM_PROCID": "0"}), "--service"))
    other = dict(parse_service(s) for s in _options(
        _agent_argv(rendered.scripts["sandbox"], shims, tmp_path, {**env, "SLURM_PROCID": "1"}), "--service"))
    assert head["sandbox-broker"] == ["sandbox-cluster", "broker", "--bind", "tcp://0.0.0.0:5555"]
    assert set(head) == {"sandbox-broker", "sandbox-worker"} and set(other) == {"sandbox-worker"}
    worker = other["sandbox-worker"]
    assert worker[:4] == ["sandbox-cluster", "worker", "--connect", "tcp://gpu007:5556"]
    assert worker[worker.index("--slots") + 1] == "128"


def test_cluster_env_reaches_every_group_and_group_env_only_its_own(example_cluster, cluster_file, tmp_path):
    path = cluster_file({"sglang.env": {"SGLANG_ONLY": "a b"}, "env": {"SHARED": "x y$z"}})
    out = _render(path, tmp_path / "r")
    for group, script in out.scripts.items():
        assert "export SHARED='x y$z'" in script  # quoted: nemo-run writes export lines unquoted
        assert ("SGLANG_ONLY" in script) == (group == "sglang")
    assert "export SHARED='x y$z'" in out.sbatch


# ----------------------------------------------------------------------------- resume


def _started_run(tmp_path, example_cluster) -> Path:
    """A run dir as the first launch and the trainer leave it: launch.json and config.json."""
    run_dir = tmp_path / "runs" / "q32"
    write_record(run_dir, LaunchRecord(executor="slurm", recipe=RECIPE, cluster=load_cluster(example_cluster)))
    (run_dir / "config.json").write_text(json.dumps(to_dict(load_recipe(RECIPE))))
    return run_dir


def test_resume_continues_on_the_same_layout_with_new_budgets(cluster_file, tmp_path, capsys, shims):
    example_cluster = cluster_file({"sglang.tp": 8, **ONE})
    run_dir = _started_run(tmp_path, example_cluster)
    code = main(["--resume", str(run_dir), "--set", "rollout.max_turns=10",
                 "--set", "rollout.max_response_tokens=24576", "--dryrun"])
    assert code == 0
    printed = capsys.readouterr().out
    sbatch = printed[:printed.index("# ---------- run-0.sh")]
    first = _render(example_cluster, run_dir)
    assert _sbatch_flags(sbatch) | {"output": ""} == _sbatch_flags(first.sbatch) | {"output": ""}
    same_id = lambda line: re.sub(r"_[0-9]{8,}/", "_ID/", line)  # noqa: E731 (nemo-run's experiment id)
    assert [same_id(s) for s in _srun_lines(sbatch)] == [same_id(s) for s in _srun_lines(first.sbatch)]
    trainer = printed[printed.index("(trainer group, run by its srun line)"):]
    env = _addresses(sbatch, shims, HOSTS)
    argv = _agent_argv(trainer.split("\n", 1)[1], shims, tmp_path, {**env, "SLURM_PROCID": "0"})
    train = argv[argv.index("megatron_tir.cli"):]
    assert train[:3] == ["megatron_tir.cli", "train", "--resume"] and train[3] == str(run_dir)
    assert "--recipe" not in train and "--out" not in train
    sets = _options(train, "--set")
    assert sets[:2] == ["rollout.max_turns=10", "rollout.max_response_tokens=24576"]
    assert "engine.urls=http://gpu005:30000,http://gpu006:30000" in sets  # the new job's hosts
    assert "sandbox.address=tcp://gpu007:5555" in sets


@pytest.mark.parametrize("extra, fragment", [
    (["--cluster", "x.yaml"], "--cluster is not taken with it"),
    (["--executor", "local"], "--executor local differs from the run's slurm"),
    (["--recipe", "tiny-cpu"], "--recipe tiny-cpu differs from the run's qwen2.5-32b-simpletir"),
    (["--set", "rollout.max_turns=zero"], "rollout.max_turns: 'zero' is not an int"),
])
def test_resume_errors(example_cluster, tmp_path, capsys, extra, fragment):
    run_dir = _started_run(tmp_path, example_cluster)
    with pytest.raises(SystemExit) as exit_:
        main(["--resume", str(run_dir), *extra, "--dryrun"])
    assert exit_.value.code == 2
    assert fragment in capsys.readouterr().err.strip().splitlines()[-1]


def test_resume_of_a_dir_tir_launch_did_not_start(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--resume", str(tmp_path), "--dryrun"])
    assert "cannot read launch.json" in capsys.readouterr().err


# ----------------------------------------------------------------------------- other layouts


def test_colocated_sglang_runs_on_the_trainers_gpus(cluster_file, shims, tmp_path):
    """The rendering of servers on every trainer node (tir-launch itself refuses colocated on more than one
    trainer node before rendering: test_cluster_file.py; four nodes here show the per-node rendering)."""
    out = _render(cluster_file({"sglang.nodes": 0, "sglang.tp": 4, **ONE}), tmp_path / "r")
    assert _sbatch_flags(out.sbatch)["nodes"] == "5" and list(out.scripts) == ["sandbox", "trainer"]
    env = _addresses(out.sbatch, shims, HOSTS[:5])
    assert env["TIR_SGLANG_NODES"] == "" and env["TIR_SANDBOX_ADDRESS"] == "tcp://gpu005:5555"
    urls = [f"http://gpu00{i}:{p}" for i in range(1, 5) for p in (30000, 30001)]
    assert env["TIR_ENGINE_URLS"] == ",".join(urls)
    argv = _agent_argv(out.scripts["trainer"], shims, tmp_path, {**env, "SLURM_PROCID": "2"})
    services = dict(parse_service(s) for s in _options(argv, "--service"))
    assert set(services) == {"sglang-30000", "sglang-30001"}
    for port, gpu in (("30000", "0"), ("30001", "4")):
        cmd = services[f"sglang-{port}"]
        assert cmd[cmd.index("--base-gpu-id") + 1] == gpu and cmd[cmd.index("--tp-size") + 1] == "4"
        assert "--enable-memory-saver" in cmd and cmd[cmd.index("--mem-fraction-static") + 1] == "0.5"
    sets = _options(argv, "--set")
    assert "engine.colocated=true" in sets and f"engine.urls={','.join(urls)}" in sets
    assert _options(argv, "--wait-http") == [",".join(urls)]


def test_one_step_asynchrony_on_colocated_sglang_is_refused_before_queueing(cluster_file, tmp_path, capsys):
    path = cluster_file({"sglang.nodes": 0, "sglang.tp": 4, "trainer.nodes": 1})  # colocated: one trainer node
    with pytest.raises(SystemExit) as exit_:
        main(["--recipe", "qwen2.5-7b-simpletir", "--executor", "slurm", "--cluster", str(path), "--out",
              str(tmp_path / "run"),
              "--set", "trainer.async=one_step", "--emit-sbatch", str(tmp_path / "job.sbatch")])
    assert exit_.value.code == 2 and not (tmp_path / "job.sbatch").exists()
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("tir-launch: error: trainer.async=one_step") and "engine.colocated=true" in last, last
    # on SGLang nodes of its own the same run is fine
    assert main(["--recipe", RECIPE, "--executor", "slurm", "--cluster", str(cluster_file({}, name="own.yaml")),
                 "--out", str(tmp_path / "run2"), "--set", "trainer.async=one_step",
                 "--emit-sbatch", str(tmp_path / "job2.sbatch")]) == 0


def test_sandbox_beside_the_trainer(cluster_file, shims, tmp_path):
    out = _render(cluster_file({"sandbox.nodes": 0}), tmp_path / "r")
    assert _sbatch_flags(out.sbatch)["nodes"] == "6" and list(out.scripts) == ["sglang", "trainer"]
    env = _addresses(out.sbatch, shims, HOSTS[:6])
    assert env["TIR_SANDBOX_ADDRESS"] == "tcp://gpu001:5555"
    first = _agent_argv(out.scripts["trainer"], shims, tmp_path, {**env, "SLURM_PROCID": "0"})
    second = _agent_argv(out.scripts["trainer"], shims, tmp_path, {**env, "SLURM_PROCID": "1"})
    assert {parse_service(s)[0] for s in _options(first, "--service")} == {"sandbox-broker", "sandbox-worker"}
    assert _options(second, "--service") == []


def test_cli_emit_sbatch_writes_the_script_and_its_group_scripts(cluster_file, tmp_path, capsys):
    target = tmp_path / "job.sbatch"
    assert main(["--recipe", RECIPE, "--executor", "slurm", "--cluster", str(cluster_file(ONE)),
                 "--out", str(tmp_path / "run"), "--emit-sbatch", str(target)]) == 0
    assert target.read_text().startswith("#!/bin/bash") and len(_srun_lines(target.read_text())) == 3
    for group in ("sandbox", "sglang", "trainer"):
        assert (tmp_path / f"job.sbatch.{group}.sh").read_text().startswith("#!/usr/bin/bash")
    assert not (tmp_path / "run").exists()  # nothing submitted, nothing recorded
    assert "wrote" in capsys.readouterr().out


def test_each_group_can_have_its_own_image_and_mounts(cluster_file, tmp_path):
    path = cluster_file({"sglang.container_image": "lmsysorg/sglang:v0.5.4", "sandbox.mounts": ["/scratch:/scratch"],
                         **ONE})
    lines = _srun_lines(_render(path, tmp_path / "runs" / "r").sbatch)
    words = [line.split() for line in lines]  # sandbox, sglang, trainer
    images = [w[w.index("--container-image") + 1] for w in words]
    mounts = [w[w.index("--container-mounts") + 1].split(",") for w in words]
    base = load_cluster(path).container_image
    assert images == [base, "lmsysorg/sglang:v0.5.4", base]
    assert ["/scratch:/scratch" in m for m in mounts] == [True, False, False]
    for m in mounts:  # the cluster's mounts and the run dir's parent reach every group
        assert "/lustre/fsw/my_project:/lustre/fsw/my_project" in m
        assert f"{tmp_path / 'runs'}:{tmp_path / 'runs'}" in m


# ----------------------------------------------------------------------------- submission


def _stand_in_slurm(tmp_path, monkeypatch, sbatch_body: str) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/bash\n" + sbatch_body)
    for tool in ("srun", "squeue", "sacct"):
        (bin_dir / tool).write_text("#!/bin/bash\nexit 0\n")
    for f in bin_dir.iterdir():
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    nemo_slurm = importlib.import_module("nemo_run.run.torchx_backend.schedulers.slurm")
    monkeypatch.setattr(nemo_slurm, "SLURM_JOB_DIRS", str(tmp_path / "slurm_jobs"))


def test_a_refused_submission_is_one_error_line(cluster_file, tmp_path, monkeypatch, capsys):
    _stand_in_slurm(tmp_path, monkeypatch, 'echo "sbatch: error: Batch job submission failed: Invalid account" >&2\n'
                                           "exit 1\n")
    path = cluster_file({"job_dir": str(tmp_path / "nemo-run"), "run_root": str(tmp_path / "runs")})
    with pytest.raises(SystemExit) as exit_:
        main(["--recipe", RECIPE, "--executor", "slurm", "--cluster", str(path), "--out", str(tmp_path / "runs" / "r")])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "tir-launch: error: sbatch refused the job: sbatch: error: Batch job submission failed: Invalid account")


def test_submit_hands_sbatch_a_script_whose_group_scripts_exist(cluster_file, tmp_path, monkeypatch, capsys):
    """``tir-launch`` without --dryrun, against stand-ins for sbatch/srun/squeue/sacct: nemo-run's
    LocalTunnel copies nothing, so what sbatch gets must already be where the job looks."""
    calls = tmp_path / "sbatch.calls"
    _stand_in_slurm(tmp_path, monkeypatch, f'printf "%s\\n" "$@" > {calls}\necho 4242\n')
    shared = tmp_path / "shared"
    path = cluster_file({"job_dir": str(shared / "nemo-run"), "run_root": str(shared / "runs"), **ONE})
    run_dir = shared / "runs" / "r1"

    assert main(["--recipe", RECIPE, "--executor", "slurm", "--cluster", str(path), "--out", str(run_dir)]) == 0
    assert "submitted experiment" in capsys.readouterr().out
    args = calls.read_text().split()
    assert args[:2] == ["--requeue", "--parsable"]
    sbatch = Path(args[2]).read_text()
    dryrun = _render(path, run_dir)
    assert _sbatch_flags(sbatch)["nodes"] == "7" and len(_srun_lines(sbatch)) == 3
    for line, group in zip(_srun_lines(sbatch), ["sandbox", "sglang", "trainer"], strict=True):
        words = line.split()
        mounts = dict(m.split(":")[::-1] for m in words[words.index("--container-mounts") + 1].split(","))
        script = Path(mounts["/nemo_run"]) / "scripts" / words[-3].rsplit("/", 1)[1]
        assert script.read_text() == dryrun.scripts[group]  # the job finds each group's script in place
    record = json.loads((run_dir / "launch.json").read_text())
    assert record["executor"] == "slurm" and record["recipe"] == RECIPE
    assert record["cluster"]["trainer"]["nodes"] == 4


@pytest.mark.parametrize("mounts, added", [
    (["/lustre/fsw/my_project:/lustre/fsw/my_project"], False),  # the run root is inside a same-path mount
    (["/lustre/fsw/my_project:/data"], True),  # visible, but not at the path the commands use
    (["/lustre/fsw/my_project/tir/runs:/lustre/fsw/my_project/tir/runs:ro"], False),
])
def test_the_run_dir_is_visible_at_its_own_path(cluster_file, mounts, added):
    path = cluster_file({"mounts": mounts, **ONE})
    run_dir = "/lustre/fsw/my_project/tir/runs/r"
    out = render(load_cluster(path), RunSpec(recipe=RECIPE, layout=trainer_layout(recipe=RECIPE), run_dir=run_dir))
    words = _srun_lines(out.sbatch)[2].split()
    got = words[words.index("--container-mounts") + 1].split(",")
    extra = "/lustre/fsw/my_project/tir/runs:/lustre/fsw/my_project/tir/runs"
    assert (extra in got) == added and all(m in got for m in mounts)


def test_a_requeued_job_continues_from_the_runs_last_checkpoint(rendered, shims, tmp_path):
    env = _addresses(rendered.sbatch, shims, HOSTS)
    run_dir = Path(env["TIR_RUN_DIR"])
    (run_dir / "checkpoints" / "step_20").mkdir(parents=True)
    (run_dir / "checkpoints" / "latest").symlink_to("step_20")
    argv = _agent_argv(rendered.scripts["trainer"], shims, tmp_path, {**env, "SLURM_PROCID": "0"})
    train = argv[argv.index("megatron_tir.cli"):]
    assert train[:4] == ["megatron_tir.cli", "train", "--resume", str(run_dir)] and "--recipe" not in train
    assert "sandbox.address=tcp://gpu007:5555" in _options(train, "--set")


def test_without_containers_the_groups_run_from_the_job_dir(cluster_file, tmp_path):
    path = cluster_file({"env": {"PATH": "/shared/venv/bin:/usr/bin:/bin"}, **ONE}, nulls=("container_image",))
    out = _render(path, tmp_path / "runs" / "r")
    for line in _srun_lines(out.sbatch):
        words = line.split()
        assert not any(w.startswith("--container") for w in words)
        assert words[words.index("--chdir") + 1].endswith("/run/code")
        script = words[-3]  # nemo-run puts the job dir's real path in place of /nemo_run
        assert script.startswith(str(load_cluster(path).job_dir)) and script.endswith(".sh")
    assert "/nemo_run" not in out.sbatch
    assert "export PATH=/shared/venv/bin:/usr/bin:/bin" in out.scripts["trainer"]

"""The sandbox group in a second allocation on the cluster file's CPU partition (the example's layout).

The main job's setup block submits it, waits until it runs, takes the broker's address from its
first host and cancels it when the main job ends; the second job runs the sandbox group's agents and
ends itself once the main job is gone. Both run here in bash with stand-ins for the Slurm commands
(``sbatch``, ``squeue``, ``scontrol``, ``scancel``, ``srun``, an instant ``sleep``) that record how
they were called.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from megatron_tir.launch.agent import parse_service
from megatron_tir.launch.cluster import load_cluster
from megatron_tir.launch.layout import trainer_layout
from megatron_tir.launch.slurm import SANDBOX_GROUP_FILE, SANDBOX_JOB_FILE, SANDBOX_JOB_ID_FILE, render
from megatron_tir.launch.spec import RunSpec

RECIPE = "qwen2.5-32b-simpletir"
GPU_HOSTS = [f"gpu{i:03d}" for i in range(1, 7)]

SHIMS = {
    # scontrol show hostnames LIST: one host a line (a list without brackets)
    "scontrol": '[ "$1 $2" = "show hostnames" ] && tr , "\\n" <<< "$3"',
    # sbatch: records its argv and the Slurm variables it was given, answers "<id>;<cluster>"
    "sbatch": 'printf "%s\\n" "$@" > "$REC/sbatch.argv"; env | grep -E "^(SLURM|SBATCH|SRUN)_" > "$REC/sbatch.slurm_env";'
              ' echo "TIR_MAIN_JOB=$TIR_MAIN_JOB TIR_RUN_DIR=$TIR_RUN_DIR" > "$REC/sbatch.env"; echo "777;cluster"',
    # squeue -h -j ID -o %T|%N: the state in $STATE (per job: $STATE_<ID> first), the node list in $NODES
    "squeue": 'job=""; fmt=""; while [ $# -gt 0 ]; do case "$1" in -j) job=$2; shift;; -o) fmt=$2; shift;; esac;'
              ' shift; done; echo "squeue $job $fmt" >> "$REC/squeue.calls"; var="STATE_$job";'
              ' if [ "$fmt" = %N ]; then echo "$NODES"; else echo "${!var:-$STATE}"; fi',
    "scancel": 'echo "$@" >> "$REC/scancel.calls"',
    "srun": 'printf "%s\\n" "$@" > "$REC/srun.argv"; echo "SLURM_PROCID=${SLURM_PROCID:-}" >> "$REC/srun.env"',
    "sleep": "exit 0",
    "python": 'printf "%s\\0" "$@" > "$REC/python.argv"',
}


@pytest.fixture
def shims(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in SHIMS.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body + "\n")
        (bin_dir / name).chmod(0o755 | stat.S_IEXEC)
    rec = tmp_path / "rec"
    rec.mkdir()
    return bin_dir, rec


def _bash(script: str, shims, env: dict[str, str]) -> subprocess.CompletedProcess:
    bin_dir, rec = shims
    full = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": os.environ.get("HOME", "/tmp"), "REC": str(rec), **env}
    return subprocess.run(["bash", "-c", script], env=full, capture_output=True, text=True, timeout=60)


def _render(path: Path, run_dir: Path):
    return render(load_cluster(path), RunSpec(recipe=RECIPE, layout=trainer_layout(recipe=RECIPE), run_dir=str(run_dir)))


def _setup_block(sbatch: str) -> str:
    start = sbatch.index("# tir-launch: one allocation")
    return sbatch[start:sbatch.index("# Command 1", start)]


def _main_env(**extra) -> dict[str, str]:
    return {"SLURM_JOB_NODELIST": ",".join(GPU_HOSTS), "SLURM_JOB_ID": "4242", "SLURM_NTASKS": "6",
            "STATE": "RUNNING", "NODES": "cpu001", **extra}


def _exports(sbatch: str, shims, **extra) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
    out = shims[1] / "env"
    result = _bash(_setup_block(sbatch) + f'\nenv -0 > "{out}"', shims, _main_env(**extra))
    if not out.exists():
        return result, {}
    pairs = (item.partition("=") for item in out.read_text().split("\0") if item.startswith("TIR_"))
    return result, {k: v for k, _, v in pairs}


def test_the_main_allocation_holds_trainer_and_sglang_only(example_cluster, tmp_path):
    out = _render(example_cluster, tmp_path / "runs" / "q32")
    flags = [line for line in out.sbatch.splitlines() if line.startswith("#SBATCH --")]
    assert "#SBATCH --nodes=6" in flags and "#SBATCH --partition=batch" in flags
    assert list(out.scripts) == ["sglang", "trainer"]  # no GPU node stands idle for the CPU-only sandbox
    main_sruns = [line for line in out.sbatch.splitlines() if line.startswith("srun --output")]
    assert len(main_sruns) == 2 and not any("--gres=gpu:0" in line for line in main_sruns)
    assert "hetjob" not in out.sbatch


def test_setup_submits_the_sandbox_allocation_and_takes_its_address(example_cluster, tmp_path, shims):
    run_dir = tmp_path / "runs" / "q32"
    out = _render(example_cluster, run_dir)
    result, env = _exports(out.sbatch, shims)
    assert result.returncode == 0, result.stderr
    rec = shims[1]
    assert env["TIR_SANDBOX_ADDRESS"] == "tcp://cpu001:5555" and env["TIR_SANDBOX_NODES"] == "cpu001"
    assert env["TIR_TRAINER_NODES"] == "gpu001,gpu002,gpu003,gpu004" and env["TIR_SGLANG_NODES"] == "gpu005,gpu006"
    assert (rec / "sbatch.argv").read_text().split() == ["--parsable", str(run_dir / "logs" / SANDBOX_JOB_FILE)]
    assert (rec / "sbatch.env").read_text().split() == ["TIR_MAIN_JOB=4242", f"TIR_RUN_DIR={run_dir}"]
    assert (rec / "sbatch.slurm_env").read_text() == ""  # this job's SLURM_* would set the second job's options
    assert (run_dir / "logs" / SANDBOX_JOB_ID_FILE).read_text().strip() == "777"
    # the EXIT trap: the main job's end cancels the second allocation
    assert (rec / "scancel.calls").read_text().split() == ["777"]
    job = (run_dir / "logs" / SANDBOX_JOB_FILE).read_text()
    flags = {line.split("=")[0]: line.partition("=")[2] for line in job.splitlines() if line.startswith("#SBATCH --")}
    assert flags["#SBATCH --partition"] == "cpu" and flags["#SBATCH --nodes"] == "1"
    assert (flags["#SBATCH --account"], flags["#SBATCH --time"], flags["#SBATCH --qos"]) == ("my_account", "04:00:00",
                                                                                             "normal")
    assert not any("gpus" in key or "gres" in key for key in flags)
    assert flags["#SBATCH --output"] == f"{run_dir}/logs/sandbox-job-%j.out"


def test_a_requeued_attempt_cancels_its_predecessors_sandbox_first(example_cluster, tmp_path, shims):
    run_dir = tmp_path / "runs" / "q32"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "logs" / SANDBOX_JOB_ID_FILE).write_text("555\n")
    result, env = _exports(_render(example_cluster, run_dir).sbatch, shims)
    assert result.returncode == 0, result.stderr
    assert (shims[1] / "scancel.calls").read_text().split() == ["555", "777"]  # the old one, then (EXIT) the new


def test_a_sandbox_allocation_that_does_not_start_fails_the_job_in_one_line(cluster_file, tmp_path, shims):
    out = _render(cluster_file({"sandbox.start_timeout_s": 60}), tmp_path / "runs" / "r")
    result, _ = _exports(out.sbatch, shims, STATE="PENDING")
    assert result.returncode == 1
    assert ("tir-launch: the sandbox allocation (job 777, partition cpu) did not start within 60 s "
            "(sandbox.start_timeout_s)") in result.stderr
    assert (shims[1] / "squeue.calls").read_text().count("squeue 777 %T") == 7  # 0, 10, ..., 60 s (sleep stood in)
    assert (shims[1] / "scancel.calls").read_text().split() == ["777"]


def test_a_sandbox_allocation_that_fails_to_start_fails_the_job_at_once(example_cluster, tmp_path, shims):
    out = _render(example_cluster, tmp_path / "runs" / "r")
    result, _ = _exports(out.sbatch, shims, STATE_777="FAILED", STATE="PENDING")
    assert result.returncode == 1
    assert "tir-launch: the sandbox allocation (job 777, partition cpu) is FAILED" in result.stderr
    assert (shims[1] / "squeue.calls").read_text().count("squeue 777 %T") == 1


def test_the_second_job_runs_the_sandbox_group_and_ends_when_the_main_job_is_gone(example_cluster, tmp_path, shims):
    run_dir = tmp_path / "runs" / "q32"
    out = _render(example_cluster, run_dir)
    result, _ = _exports(out.sbatch, shims)
    assert result.returncode == 0, result.stderr
    rec = shims[1]
    (rec / "scancel.calls").unlink()
    job = run_dir / "logs" / SANDBOX_JOB_FILE
    # the main job is gone (squeue knows it no more): the watch loop cancels the second job after 5 checks
    env = {"SLURM_JOB_NODELIST": "cpu001,cpu002", "SLURM_JOB_ID": "777", "TIR_MAIN_JOB": "4242", "STATE": "",
           "TIR_RUN_DIR": str(run_dir)}
    result = _bash(f'bash "{job}"; wait', shims, env)
    assert result.returncode == 0, result.stderr
    srun = (rec / "srun.argv").read_text().split("\n")
    assert srun[:5] == ["--nodes=1", "--ntasks=1", "--ntasks-per-node=1", "--cpus-per-task=192", "--kill-on-bad-exit=1"]
    assert srun[srun.index("--container-image") + 1] == load_cluster(example_cluster).container_image
    assert f"{tmp_path / 'runs'}:{tmp_path / 'runs'}" in srun[srun.index("--container-mounts") + 1].split(",")
    assert srun[-3:-1] == ["bash", str(run_dir / "logs" / SANDBOX_GROUP_FILE)]
    for _ in range(100):  # the watch loop runs in the background of the job's script
        if (rec / "scancel.calls").exists():
            break
        subprocess.run(["sleep", "0.05"])
    assert (rec / "scancel.calls").read_text().split() == ["777"]
    assert (rec / "squeue.calls").read_text().splitlines()[-5:] == ["squeue 4242 %T"] * 5


def test_the_sandbox_group_script_serves_from_the_second_allocations_hosts(example_cluster, tmp_path, shims):
    run_dir = tmp_path / "runs" / "q32"
    result, _ = _exports(_render(example_cluster, run_dir).sbatch, shims)
    assert result.returncode == 0, result.stderr
    group = run_dir / "logs" / SANDBOX_GROUP_FILE
    argv_file = shims[1] / "python.argv"

    def services(procid: str) -> dict[str, list[str]]:
        env = {"SLURM_PROCID": procid, "TIR_RUN_DIR": str(run_dir), "TIR_SANDBOX_WORKER_ADDRESS": "tcp://cpu001:5556"}
        done = _bash(f'bash "{group}"', shims, env)
        assert done.returncode == 0, done.stderr
        argv = argv_file.read_text().split("\0")[:-1]
        return dict(parse_service(argv[i + 1]) for i, a in enumerate(argv) if a == "--service")

    head, other = services("0"), services("1")
    assert head["sandbox-broker"] == ["sandbox-cluster", "broker", "--bind", "tcp://0.0.0.0:5555"]
    assert set(other) == {"sandbox-worker"}
    worker = other["sandbox-worker"]
    assert worker[:4] == ["sandbox-cluster", "worker", "--connect", "tcp://cpu001:5556"]
    assert worker[worker.index("--slots") + 1] == "128"
    text = group.read_text()
    assert "export NCCL_SOCKET_IFNAME=ib0" in text and "export GLOO_SOCKET_IFNAME=ib0" in text


def test_the_trainer_is_given_the_second_allocations_broker(example_cluster, tmp_path, shims):
    out = _render(example_cluster, tmp_path / "runs" / "q32")
    result, env = _exports(out.sbatch, shims)
    assert result.returncode == 0, result.stderr
    done = _bash(out.scripts["trainer"], shims, {**env, "SLURM_PROCID": "0", "SLURM_JOB_ID": "4242"})
    assert done.returncode == 0, done.stderr
    argv = (shims[1] / "python.argv").read_text().split("\0")[:-1]
    assert argv[argv.index("--wait-tcp") + 1] == "tcp://cpu001:5555"
    assert "sandbox.address=tcp://cpu001:5555" in argv
    assert not [a for a in argv if a.startswith("sandbox-")]  # no sandbox beside the trainer


def test_socket_interfaces_reach_the_batch_shell_and_every_group(example_cluster, tmp_path):
    out = _render(example_cluster, tmp_path / "runs" / "q32")
    for name in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        assert f"export {name}=ib0" in out.sbatch.splitlines()  # the batch shell (and so every srun step)
        for script in out.scripts.values():
            assert f"export {name}=ib0" in script.splitlines()


def test_without_containers_the_second_job_runs_the_group_from_the_nodes_environment(cluster_file, tmp_path, shims):
    path = cluster_file({"env": {"PATH": "/shared/venv/bin:/usr/bin:/bin"}}, nulls=("container_image",))
    run_dir = tmp_path / "runs" / "r"
    result, _ = _exports(_render(path, run_dir).sbatch, shims)
    assert result.returncode == 0, result.stderr
    job = (run_dir / "logs" / SANDBOX_JOB_FILE).read_text()
    (srun,) = [line for line in job.splitlines() if line.startswith("srun ")]
    assert "--container" not in srun
    assert "export PATH=/shared/venv/bin:/usr/bin:/bin" in (run_dir / "logs" / SANDBOX_GROUP_FILE).read_text()

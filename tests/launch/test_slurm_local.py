"""The generated sbatch run for real by a Slurm (opt-in: ``pytest -m slurm tests/launch``).

Needs ``sbatch``/``squeue``/``srun`` on the PATH and a partition of at least three nodes
whose host names resolve and that share this file system; ``tests/launch/local_slurm.sh``
starts one on this host (Debian's slurm-wlm: slurmctld and three slurmd, fake GPUs).
``TIR_SLURM_PARTITION`` (default ``batch``), ``TIR_SLURM_GPUS_PER_NODE`` (2) and
``TIR_SLURM_CPUS_PER_NODE`` (2) describe it.

Everything is real (sbatch, the node split, srun steps, the agents, the sandbox broker and
worker on their node) except the two GPU programs: ``sglang.launch_server`` is a stand-in
that answers ``/health``, and ``torchrun`` is a stand-in for the GPU trainer that checks
what the trainer would get (the servers answer, a cell runs in the sandbox) and then fails
on purpose, so the job's end and the failure's log tail are checked too.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from megatron_tir.launch.cli import main

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
PARTITION = os.environ.get("TIR_SLURM_PARTITION", "batch")
GPUS = int(os.environ.get("TIR_SLURM_GPUS_PER_NODE", "2"))
CPUS = int(os.environ.get("TIR_SLURM_CPUS_PER_NODE", "2"))

TORCHRUN = '''#!{python}
import json, os, socket, subprocess, sys, urllib.request
argv = sys.argv[1:]
sets = dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "--set")
health = {{u: urllib.request.urlopen(u + "/health", timeout=10).status for u in sets["engine.urls"].split(",")}}
cell = subprocess.run([sys.executable, "-m", "sandbox_cluster.cli", "run", "-", "--connect", sets["sandbox.address"],
                       "--timeout", "60"], input="print(6 * 7)", capture_output=True, text=True, timeout=300)
report = {{"argv": argv, "node": os.environ.get("SLURMD_NODENAME"), "health": health, "cell": cell.stdout.strip(),
          "cell_err": cell.stderr[-2000:]}}
run_dir = argv[argv.index("--out") + 1]
with open(os.path.join(run_dir, "trainer-standin.json"), "w") as f:
    json.dump(report, f)
print("trainer stand-in: checked the addresses; failing on purpose", flush=True)
sys.exit(3)
'''

SGLANG_SERVER = '''import argparse, http.server
p = argparse.ArgumentParser()
p.add_argument("--port", type=int)
p.add_argument("--host")
args, _ = p.parse_known_args()

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

http.server.HTTPServer((args.host, args.port), Health).serve_forever()
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _slurm_nodes() -> int:
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return 0
    out = subprocess.run(["sinfo", "-h", "-p", PARTITION, "-o", "%D"], capture_output=True, text=True, check=False)
    return sum(int(x) for x in out.stdout.split() if x.isdigit()) if out.returncode == 0 else 0


@pytest.mark.skipif(_slurm_nodes() < 3, reason=f"needs a Slurm with a partition {PARTITION!r} of >= 3 nodes "
                                                "(tests/launch/local_slurm.sh starts one)")
def test_the_sbatch_runs_the_three_groups_on_their_nodes(tmp_path, monkeypatch, capsys):
    import importlib

    stubs = tmp_path / "stubs"
    (stubs / "bin").mkdir(parents=True)
    (stubs / "sglang").mkdir()
    (stubs / "bin" / "torchrun").write_text(TORCHRUN.format(python=sys.executable))
    (stubs / "bin" / "torchrun").chmod(0o755)
    (stubs / "sglang" / "__init__.py").write_text("")
    (stubs / "sglang" / "launch_server.py").write_text(SGLANG_SERVER)
    sglang_port, sandbox_port = _free_port(), _free_port()
    cluster = {
        "account": "test", "partition": PARTITION, "time": "00:10:00", "container_image": None,
        "partitions": {PARTITION: {"gpus_per_node": GPUS, "cpus_per_node": CPUS}},
        "job_dir": str(tmp_path / "nemo-run"), "run_root": str(tmp_path / "runs"),
        "env": {"PATH": f"{stubs / 'bin'}:{Path(sys.executable).parent}:/usr/bin:/bin",
                "PYTHONPATH": f"{stubs}:{REPO}"},
        "trainer": {"nodes": 1}, "sglang": {"nodes": 1, "port": sglang_port},
        "sandbox": {"nodes": 1, "workers_per_node": 1, "port": sandbox_port},
    }
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cluster))
    nemo_slurm = importlib.import_module("nemo_run.run.torchx_backend.schedulers.slurm")
    monkeypatch.setattr(nemo_slurm, "SLURM_JOB_DIRS", str(tmp_path / "slurm_jobs"))
    run_dir = tmp_path / "runs" / "r1"

    assert main(["--recipe", "tiny-cpu", "--executor", "slurm", "--cluster", str(path), "--out", str(run_dir)]) == 0
    capsys.readouterr()
    deadline = time.monotonic() + 420
    sbatch_out: list[str] = []
    while time.monotonic() < deadline:
        sbatch_out = glob.glob(str(tmp_path / "nemo-run" / "**" / "sbatch_*.out"), recursive=True)
        if sbatch_out and "job exited with code" in Path(sbatch_out[0]).read_text():
            break
        time.sleep(2)
    assert sbatch_out, "the job never started"
    batch_log = Path(sbatch_out[0]).read_text()
    assert "job exited with code 3" in batch_log, batch_log[-3000:]  # the trainer's exit status is the job's

    report = json.loads((run_dir / "trainer-standin.json").read_text())
    argv = report["argv"]
    first, second, third = _job_hosts(batch_log)
    assert report["node"] == first  # the trainer on the allocation's first node
    assert argv[:2] == ["--nnodes=1", f"--nproc-per-node={GPUS}"]
    assert f"--rdzv-endpoint={first}:29500" in argv
    assert argv[argv.index("-m"):argv.index("-m") + 7] == ["-m", "megatron_tir.cli", "train", "--recipe", "tiny-cpu",
                                                          "--out", str(run_dir)]
    assert report["health"] == {f"http://{second}:{sglang_port}": 200}  # the SGLang node's server answered
    assert report["cell"] == "42", report["cell_err"]  # a cell ran in the sandbox on the third node
    assert f"engine.urls=http://{second}:{sglang_port}" in argv and f"sandbox.address=tcp://{third}:{sandbox_port}" in argv
    assert (run_dir / "logs").is_dir() and (run_dir / "launch.json").is_file()
    trainer_log = next(Path(p).read_text() for p in glob.glob(str(tmp_path / "nemo-run" / "**" / "log-*-2_*.out"),
                                                              recursive=True))
    assert "failed with exit status 3" in trainer_log and "failing on purpose" in trainer_log


def _job_hosts(batch_log: str) -> tuple[str, str, str]:
    """The trainer, SGLang and sandbox hosts, from the setup block's first echo line."""
    line = next(line for line in batch_log.splitlines() if line.startswith("tir-launch: trainer "))
    parts = [p.strip() for p in line.removeprefix("tir-launch: ").split("|")]
    return tuple(p.split()[1] for p in parts)  # type: ignore[return-value]

"""Slurm's pre-timeout signal on its way to the trainer: the sbatch asks for it, the batch shell passes it to
the trainer's srun, the node agent passes it to torchrun's workers (torchrun itself survives it)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from megatron_tir.launch import slurm
from megatron_tir.launch.cluster import load_cluster
from megatron_tir.launch.layout import trainer_layout
from megatron_tir.launch.spec import RunSpec

ROOT = Path(__file__).resolve().parents[2]


def test_the_sbatch_asks_for_the_signal_and_passes_it_to_the_trainer_group(cluster_file, tmp_path):
    cluster = load_cluster(cluster_file({"signal_before_end_s": 1200}))
    spec = RunSpec(recipe="qwen2.5-32b-simpletir", layout=trainer_layout(recipe="qwen2.5-32b-simpletir"),
                   run_dir=str(tmp_path / "runs" / "r"))
    rendered = slurm.render(cluster, spec)
    assert "#SBATCH --signal=B:USR1@1200" in rendered.sbatch.splitlines()
    (trap,) = [line for line in rendered.sbatch.splitlines() if line.startswith("trap ") and line.endswith(" USR1")]
    # the trap, in bash, with two stand-in group steps: USR1 reaches the last one (the trainer's srun) only
    script = textwrap.dedent(f"""\
        {trap}
        sleep 30 & pids[0]=$!
        sleep 30 & pids[1]=$!
        sleep 0.5; kill -USR1 $$  # (after the steps have started)
        wait "${{pids[1]}}"; echo "last=$?"
        kill -0 "${{pids[0]}}" && echo "first running"; kill "${{pids[0]}}"
        """)
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60).stdout
    assert "passed to the trainer" in out and f"last={128 + signal.SIGUSR1}" in out and "first running" in out


STAND_IN_TORCHRUN = """
import signal, subprocess, sys
worker = '''
import signal, sys, time, pathlib
def stop(signum, frame):
    pathlib.Path(sys.argv[1]).write_text("checkpoint")
    sys.exit(0)
signal.signal(signal.SIGUSR1, stop)
print("worker ready", flush=True)
time.sleep(60)
sys.exit(3)
'''
child = subprocess.Popen([sys.executable, "-c", worker, sys.argv[1]])
sys.exit(child.wait())
"""


def test_the_agent_passes_the_signal_to_torchruns_workers(tmp_path):
    marker = tmp_path / "saved"
    agent = subprocess.Popen([sys.executable, "-m", "megatron_tir.launch.agent", "--log-dir", str(tmp_path / "logs"),
                              "--", sys.executable, "-c", STAND_IN_TORCHRUN, str(marker)],
                             env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        log = tmp_path / "logs" / "main.log"
        deadline = time.monotonic() + 60
        while not (log.exists() and "worker ready" in log.read_text()):
            assert agent.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        agent.send_signal(signal.SIGUSR1)
        _, err = agent.communicate(timeout=60)
    finally:
        agent.kill()
    assert agent.returncode == 0, err[-2000:]  # the stand-in torchrun ignored it, its worker exited 0
    assert marker.read_text() == "checkpoint"
    assert re.search(r"SIGUSR1: passed to the main command's workers \[\d+\]", err)

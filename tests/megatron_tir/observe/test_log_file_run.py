"""A run that speaks in a log file: a non-TTY ``tiny-cpu`` run logs heartbeat lines during its phases, the
``step 0 | held-out`` line before step 1, and a resume logs what its ``--set`` changed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_tir.observe.heartbeat import INTERVAL_ENV

ROOT = Path(__file__).resolve().parents[3]
# a beat every 50 ms stands in for the minute of a long phase (tiny-cpu's phases take a fraction of a second)
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", INTERVAL_ENV: "0.05"}


def _train(*args: str) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-m", "megatron_tir.cli", "train", *args], env=ENV, capture_output=True,
                       text=True, timeout=600, cwd=ROOT)  # stderr is a pipe: no TTY, as under nohup or Slurm
    assert p.returncode == 0, p.stderr[-3000:]
    return p


@pytest.mark.slow
def test_heartbeat_step0_line_and_resume_changes(tmp_path):
    run = tmp_path / "run"
    _train("--recipe", "tiny-cpu", "--set", "trainer.steps=1", "--set", "trainer.progress=true", "--out", str(run))
    lines = (run / "train.log").read_text().splitlines()
    beats = [i for i, x in enumerate(lines) if "megatron_tir.heartbeat INFO heartbeat | " in x]
    step0 = next(i for i, x in enumerate(lines) if "megatron_tir.steps INFO step 0 | held-out 0.000 | " in x)
    step1 = next(i for i, x in enumerate(lines) if "megatron_tir.steps INFO step 1/1 | " in x)
    assert beats and step0 < step1
    assert any(" traj" in lines[i] for i in beats)
    assert all("\r" not in x and "\x1b" not in x for x in lines)  # no bar in the file

    p = _train("--resume", str(run), "--set", "trainer.steps=2", "--set", "rollout.max_turns=3")
    changed = [x.split(": ", 1)[1] for x in p.stderr.splitlines() if f"resume {run}: " in x]
    assert changed == ["rollout.max_turns 2 -> 3", "trainer.steps 1 -> 2"]

"""Slurm's pre-timeout signal (SIGUSR1) and SIGTERM to a tiny-cpu run: it ends the step in progress, writes a
complete run checkpoint, exits 0, and --resume continues after it; the time-based checkpoint interval."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

PY = sys.executable
ROOT = Path(__file__).resolve().parents[3]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _metrics(run: Path) -> dict[int, dict]:
    path = run / "metrics.jsonl"
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines())} if path.exists() else {}


def _state(run: Path) -> dict:
    ck = run / "checkpoints"
    return json.loads((ck / (ck / "latest").read_text() / "trainer_state.json").read_text())


@pytest.mark.slow  # ~2 min each: a run, a signal, a resume
@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_a_signal_ends_the_run_with_a_checkpoint_and_exit_0_then_resume_continues(tmp_path, sig):
    run = tmp_path / "run"
    proc = subprocess.Popen([PY, "-m", "megatron_tir.cli", "train", "--recipe", "tiny-cpu", "--out", str(run),
                             "--set", "trainer.steps=40", "--set", "trainer.checkpoint.every=0",
                             "--set", "data.eval_size=0"], env=ENV, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while 1 not in _metrics(run):  # the first step is done: the loop runs
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.2)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    stopped = _state(run)["step"]
    assert 1 <= stopped < 40 and max(_metrics(run)) == stopped  # the step in progress finished, no more
    assert f"stopped after step {stopped} on a signal" in err
    ck = run / "checkpoints" / (run / "checkpoints" / "latest").read_text()
    assert (ck / "trainer_state.json").is_file() and any(ck.rglob("metadata.json"))
    p = subprocess.run([PY, "-m", "megatron_tir.cli", "train", "--resume", str(run), "--set",
                        f"trainer.steps={stopped + 1}"], env=ENV, cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert _state(run)["step"] == stopped + 1 and sorted(_metrics(run)) == list(range(1, stopped + 2))


def test_time_based_checkpoints(tmp_path):
    """checkpoint.minutes (here ~0: due after every step) writes checkpoints without a step interval."""
    run = tmp_path / "run"
    p = subprocess.run([PY, "-m", "megatron_tir.cli", "train", "--recipe", "tiny-cpu", "--out", str(run),
                        "--set", "trainer.steps=3", "--set", "trainer.checkpoint.every=0",
                        "--set", "trainer.checkpoint.minutes=0.0001", "--set", "trainer.checkpoint.keep_last=5",
                        "--set", "data.eval_size=0"], env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert sorted(d.name for d in (run / "checkpoints").glob("step_*")) == ["step_1", "step_2", "step_3"]

"""Validation before the slow start (issue 19): a bad model, data, layout or sandbox setting is one
line (exit 2) before megatron-core is imported or any process is started, and leaves no run
directory; a directory without a checkpoint is reused by ``--out``; a resume hides re-run steps
from TensorBoard."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[3]

# Loaded at interpreter start (PYTHONPATH): logs every process the CLI starts and, at exit,
# whether megatron-core was imported (the learner) -- the probe the assertions read.
SITECUSTOMIZE = '''
import atexit, os, subprocess, sys
import multiprocessing.process as _mpp

_LOG = os.environ["PROBE_LOG"]


def _note(what):
    with open(_LOG, "a") as f:
        f.write(what + "\\n")


_popen = subprocess.Popen.__init__
def _popen_init(self, args, *a, **k):
    _note(f"process {args!r}")
    _popen(self, args, *a, **k)
subprocess.Popen.__init__ = _popen_init

_start = _mpp.BaseProcess.start
def _mp_start(self):
    _note(f"process multiprocessing {self.name}")
    _start(self)
_mpp.BaseProcess.start = _mp_start

_fork = os.fork
def _os_fork():
    _note("process fork")
    return _fork()
os.fork = _os_fork

atexit.register(lambda: _note(f"megatron imported: {'megatron.core' in sys.modules}"))
'''


@pytest.fixture
def probed(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    log = tmp_path / "probe.log"

    def run(*args, env=None):
        full_env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{ROOT}", "PROBE_LOG": str(log),
                    "OMP_NUM_THREADS": "1", **(env or {})}
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "-m", "megatron_tir.cli", "train", *args], env=full_env,
                           capture_output=True, text=True, timeout=300, cwd=ROOT)
        return p, time.monotonic() - t0, log.read_text().splitlines() if log.exists() else []
    return run


@pytest.fixture
def bad_parquet(tmp_path):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"question": ["1+1?"], "answer": ["2"]}), path)
    return path


@pytest.fixture
def long_parquet(tmp_path):
    """Three verl rows; row 1's prompt is longer than tiny-qwen2's context (2048) leaves beside the budget."""
    path = tmp_path / "long.parquet"
    questions = ["What is 1 + 1?", "Add these up: " + " + ".join(["12345"] * 2000) + "?", "What is 2 + 2?"]
    pq.write_table(pa.table({"prompt": [[{"role": "user", "content": q}] for q in questions],
                             "reward_model": [{"ground_truth": a, "style": "rule"} for a in ("2", "0", "4")]}), path)
    return path


@pytest.mark.parametrize("overrides,env,message", [
    (["model=/no/such/model"], {}, "model '/no/such/model' is neither"),
    (["data.train=BAD"], {}, "missing column(s) prompt, reward_model"),
    (["data.eval=BAD"], {}, "missing column(s) prompt, reward_model"),
    (["learner.tp=3"], {"WORLD_SIZE": "3", "RANK": "1"}, "learner.tp=3 learner.pp=1 do not fit model tiny-qwen2: "
                                                         "tp=3 does not divide the attention heads (4)"),
    (["learner.pp=2"], {"WORLD_SIZE": "3", "RANK": "0"}, "WORLD_SIZE=3 is not a multiple of learner.tp x learner.pp"),
    (["sandbox.workers=0"], {}, "sandbox workers must be >= 1"),
    (["trainer.loss.clip_high=nan"], {}, "trainer.loss.clip_high must be a finite number"),
    # issue 37: nothing listening at the sandbox address, a prompt longer than the context leaves room for
    (["sandbox.address=tcp://127.0.0.1:1", "sandbox.probe_timeout_s=2"], {},
     "sandbox.address=tcp://127.0.0.1:1: no sandbox broker answered within 2 s"),
    (["data.train=LONG"], {}, "data.train row 1: the prompt is "),
])
def test_a_bad_start_is_refused_before_the_learner_and_the_sandbox(probed, tmp_path, bad_parquet, long_parquet,
                                                                   overrides, env, message):
    out = tmp_path / "run"
    sets = [a for o in overrides for a in ("--set", o.replace("BAD", str(bad_parquet)).replace("LONG", str(long_parquet)))]
    p, elapsed, probe = probed("--recipe", "tiny-cpu", *sets, "--out", str(out), env=env)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("megatron-tir: error: "), p.stderr
    assert message in lines[0], lines[0]
    assert probe == ["megatron imported: False"], probe  # no learner, no process (sandbox, engine, torchrun)
    assert elapsed < 60, elapsed
    assert not out.exists()


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"recipe": None, "resume": None, "out": None, "overrides": [], **kw})


def test_a_run_directory_without_a_checkpoint_is_reused_by_out(tmp_path, caplog):
    from megatron_tir.train.cli import prepare

    run = tmp_path / "run"
    (run / "checkpoints" / ".tmp-step_1").mkdir(parents=True)  # an attempt that died in its first save
    (run / "config.json").write_text("{}")
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    cfg, run_dir, state = prepare(_args(recipe="tiny-cpu", out=str(run)))
    assert run_dir == run and state.step == 0
    assert "reusing a run directory that holds no checkpoint; the run starts fresh" in caplog.text
    with pytest.raises(ValueError, match=r"the run has no checkpoint yet \(a directory without one is reused by "
                                         r"--recipe NAME --out"):
        prepare(_args(resume=str(run)))


def test_out_refuses_a_run_with_checkpoints_and_foreign_directories(tmp_path):
    from megatron_tir.train.cli import prepare

    run = tmp_path / "run"
    (run / "checkpoints" / "step_2").mkdir(parents=True)
    (run / "checkpoints" / "step_2" / "trainer_state.json").write_text(json.dumps({"step": 2}))
    with pytest.raises(ValueError, match="holds a run with checkpoints .continue it with --resume"):
        prepare(_args(recipe="tiny-cpu", out=str(run)))
    other = tmp_path / "home"
    other.mkdir()
    (other / "thesis.tex").write_text("")
    with pytest.raises(ValueError, match="is not a run directory .it holds thesis.tex"):
        prepare(_args(recipe="tiny-cpu", out=str(other)))


def test_a_resume_shows_each_step_once_in_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_tir.observe.trackers import TensorBoardTracker

    first = TensorBoardTracker(tmp_path, None, purge_step=0)
    for step in (1, 2, 3, 4):  # the checkpoint covers steps 1-2; 3 and 4 ran before a crash
        first.log_metrics(step, {"train/loss": float(step)})
    first.close()
    resumed = TensorBoardTracker(tmp_path, None, purge_step=3)  # megatron_tir.train.loop: state.step + 1
    for step in (3, 4, 5):
        resumed.log_metrics(step, {"train/loss": 10.0 * step})
    resumed.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    points = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert points == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0), (5, 50.0)]


def test_a_run_stopped_by_non_finite_steps_is_one_line_exit_1(tmp_path, capsys, monkeypatch):
    from megatron_tir.finite import NonFiniteTraining
    from megatron_tir.train import cli, run

    def stopped(*_a, **_k):
        raise NonFiniteTraining("stopped at step 4: 3 consecutive steps with non-finite weights")

    monkeypatch.setattr(run, "run_training", stopped)
    code = cli.run_train_command(_args(recipe="tiny-cpu", out=str(tmp_path / "run")))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err == ["megatron-tir: error: stopped at step 4: 3 consecutive steps with non-finite weights"]


def test_a_resume_of_damaged_checkpoints_is_refused_before_the_learner(probed, tmp_path):
    """Issue 37: both steps damaged (bytes changed, sizes kept: the cheap check passes them) -- one line,
    exit 2, and neither megatron-core nor any process was started."""
    from megatron_tir.policy.checkpoint import manifest
    from megatron_tir.train.config import to_dict
    from megatron_tir.train.recipes import load_recipe

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(to_dict(load_recipe("tiny-cpu"))))
    for step in (1, 2):
        d = run / "checkpoints" / f"step_{step}"
        (d / "policy").mkdir(parents=True)
        (d / "trainer_state.json").write_text(json.dumps({"step": step, "data_position": 4 * step}))
        (d / "policy" / "__0_0.distcp").write_bytes(bytes(range(256)) * 64)
        manifest.write_manifest(d)
        with open(d / "policy" / "__0_0.distcp", "r+b") as f:
            f.seek(1000)
            f.write(b"\xff" * 8)
    (run / "checkpoints" / "latest").write_text("step_2")
    p, elapsed, probe = probed("--resume", str(run))
    errors = [line for line in p.stderr.splitlines() if "error" in line.lower()]  # (the skips are warnings)
    assert p.returncode == 2 and len(errors) == 1 and errors[0].startswith("megatron-tir: error: no intact checkpoint"), \
        p.stderr
    assert "step_2: policy/__0_0.distcp is damaged (CRC-32" in errors[0] and "step_1: policy/__0_0.distcp" in errors[0]
    assert "Traceback" not in p.stderr
    assert probe == ["megatron imported: False"], probe
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_1", "step_2"]  # untouched

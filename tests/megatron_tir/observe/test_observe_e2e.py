"""A ``tiny-cpu`` step with ``progress=false``: the per-step line on the console and in RUN_DIR/train.log
(no escape codes, no megatron-core bucket dumps or Apex warnings), the rollout dump read back by
``megatron-tir show``, and the step metrics where W&B (offline) and MLflow (file store) put them, read
back with those libraries' own readers. W&B / MLflow parts are skipped when the library is absent."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_tir.cli import main

ROOT = Path(__file__).resolve().parents[3]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
HAS = {name: importlib.util.find_spec(name) is not None for name in ("wandb", "mlflow")}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run = tmp_path_factory.mktemp("observe") / "run"
    loggers = ",".join(["jsonl", "tensorboard"] + [n for n, ok in HAS.items() if ok])
    p = subprocess.run([sys.executable, "-m", "megatron_tir.cli", "train", "--recipe", "tiny-cpu",
                        "--set", "trainer.steps=1", "--set", "trainer.progress=false",
                        "--set", f"trainer.log.loggers={loggers}", "--set", "trainer.log.wandb_mode=offline",
                        "--out", str(run)], env=ENV, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    return run, p.stderr


def _metrics(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def test_step_line_on_the_console_and_in_the_log_file(run):
    run_dir, stderr = run
    log_text = (run_dir / "train.log").read_text()
    for text in (stderr, log_text):
        step0, line = [x for x in text.splitlines() if "megatron_tir.steps" in x][:2]
        assert "step 0 | held-out 0.000 | " in step0  # the evaluation before training, as soon as it ends
        assert "step 1/1 | reward 0.000 | held-out" in line and "| rows " in line and " s (rollout " in line
        assert "\x1b" not in text and "\r" not in text  # no colours, no progress bars
    assert "Params for bucket" not in stderr and "OptimizerConfig(" not in stderr  # megatron-core dumps
    assert "Apex is not installed" not in stderr and "full scope is deprecated" not in stderr
    assert "zygote" not in stderr and "protection " not in stderr  # sandbox lines at info: only problems


def test_dump_is_written_and_shown(run, capsys):
    run_dir, _ = run
    assert main(["show", str(run_dir), "--step", "1", "--filter", "train", "--limit", "1", "--color", "never"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("== step 1 · train · group ") and "[turn 0 · " in out
    assert "1 of 4 matching trajectories of step 1 (dumped steps: 0, 1)" in out


def test_tensorboard_has_the_scalars_and_the_sample_text(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run[0] / "tb"), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("rollout/reward")] == [1]
    assert "rollouts/train/text_summary" in acc.Tags()["tensors"]


@pytest.mark.skipif(not HAS["wandb"], reason="wandb is not installed (pip install 'megatron-tir[trackers]')")
def test_wandb_offline_run_holds_the_step_metrics(run):
    run_dir, _ = run
    files = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    p = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(files[0])], env=ENV,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    records = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    history = {r["history"]["step"]["num"] if "num" in r["history"].get("step", {}) else 0: r["history"]["item"]
               for r in records if r.get("type") == "history"}
    m = _metrics(run_dir)
    assert history[1]["rollout/reward"] == m[1]["rollout/reward"]
    assert history[1]["train/grad_norm"] == pytest.approx(m[1]["train/grad_norm"])
    config = next(r["run"]["config"] for r in records if r.get("type") == "run")
    assert config["update"]["trainer"]["mode"] == "stop_without_filter"  # the resolved config as hyper-parameters


@pytest.mark.skipif(not HAS["mlflow"], reason="mlflow is not installed (pip install 'megatron-tir[trackers]')")
def test_mlflow_file_store_holds_the_step_metrics(run):
    from mlflow import MlflowClient

    run_dir, _ = run
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    m = _metrics(run_dir)
    history = client.get_metric_history(run_id, "train/grad_norm")
    assert [(h.step, h.value) for h in history] == [(1, pytest.approx(m[1]["train/grad_norm"]))]
    assert [h.step for h in client.get_metric_history(run_id, "eval/reward")] == [0, 1]
    info = client.get_run(run_id)
    assert info.data.params["trainer.mode"] == "stop_without_filter" and info.info.status == "FINISHED"
    assert any(a.path == "rollouts" for a in client.list_artifacts(run_id))

"""Runs on this machine through nemo-run's LocalExecutor: the sandbox cluster as a service of
the node agent, the trainer as its main command."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_tir.launch.cli import main
from megatron_tir.launch.layout import TrainerLayout
from megatron_tir.launch.local import run_local
from megatron_tir.launch.spec import RunSpec

REPO = Path(__file__).resolve().parents[2]


def _trainer_cli_exists() -> bool:
    probe = subprocess.run([sys.executable, "-m", "megatron_tir.cli", "train", "--help"], cwd=REPO,
                           capture_output=True, timeout=120, check=False)
    return probe.returncode == 0


def test_a_failing_trainer_ends_the_run_with_its_status_and_log(tmp_path, monkeypatch):
    # A recipe the trainer does not know: megatron-tir exits 2 with a one-line error, after the
    # agent has started the sandbox and seen it answer.
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    spec = RunSpec(recipe="no-such-recipe", layout=TrainerLayout(model="tiny-qwen2", tp=1, pp=1, sandbox_workers=1),
                   run_dir=str(tmp_path / "run"))
    result = run_local(spec, tail_logs=False, base_dir=str(tmp_path / "nemo"))
    assert result.exit_code == 2
    logs = tmp_path / "run" / "logs"
    assert (logs / "main.exit").read_text() == "2\n"
    assert "error" in (logs / "main.log").read_text()
    task_log = Path(result.task_log).read_text()  # nemo-run's log of the task: the agent's output
    (address,) = re.findall(r"--set sandbox\.address=(tcp://127\.0\.0\.1:[0-9]+)", task_log)
    assert f"broker: clients at {address}" in (logs / "sandbox.log").read_text()  # the trainer got our sandbox
    assert "failed with exit status 2" in task_log  # and its failure's tail is at the end of the log
    assert task_log.rstrip().endswith("=== end")


@pytest.mark.slow
@pytest.mark.skipif(not _trainer_cli_exists(), reason="`megatron-tir train` is not on this branch yet (trainer issue)")
def test_tiny_cpu_runs_to_completion_and_resumes_with_more_turns(tmp_path, monkeypatch, capsys):
    import nemo_run.config

    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.setattr(nemo_run.config, "_NEMORUN_HOME", str(tmp_path / "nemo"))
    run_dir = tmp_path / "run"
    code = main(["--recipe", "tiny-cpu", "--executor", "local", "--out", str(run_dir), "--set", "trainer.steps=2"])
    out = capsys.readouterr().out
    assert code == 0, (run_dir / "logs" / "main.log").read_text()[-3000:]
    assert f"run dir: {run_dir}" in out
    assert json.loads((run_dir / "launch.json").read_text())["executor"] == "local"
    config = json.loads((run_dir / "config.json").read_text())
    sandbox_log = (run_dir / "logs" / "sandbox.log").read_text()
    assert config["sandbox"]["address"].startswith("tcp://127.0.0.1:")
    assert f"broker: clients at {config['sandbox']['address']}" in sandbox_log  # the agent's sandbox served it
    lines = [line for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert len(lines) >= 2  # one line per step (contract: RUN_DIR/metrics.jsonl)
    assert (run_dir / "checkpoints" / "latest").exists()
    assert (run_dir / "logs" / "main.exit").read_text() == "0\n"

    # The turn extension: continue the run one more step with 10 turns, on a new sandbox.
    code = main(["--resume", str(run_dir), "--set", "trainer.steps=3", "--set", "rollout.max_turns=10"])
    assert code == 0, (run_dir / "logs" / "main.log").read_text()[-3000:]
    resumed = json.loads((run_dir / "config.json").read_text())
    assert resumed["rollout"]["max_turns"] == 10 and resumed["trainer"]["steps"] == 3
    assert resumed["sandbox"]["address"] != config["sandbox"]["address"]  # the new launch's sandbox
    assert (run_dir / "checkpoints" / "step_3").is_dir()


def test_local_resume_continues_the_run_with_new_budgets(tmp_path, capsys):
    from megatron_tir.launch.spec import LaunchRecord, write_record
    from megatron_tir.train.config import to_dict
    from megatron_tir.train.recipes import load_recipe

    run_dir = tmp_path / "run"
    write_record(run_dir, LaunchRecord(executor="local", recipe="tiny-cpu", cluster=None))
    (run_dir / "config.json").write_text(json.dumps(to_dict(load_recipe("tiny-cpu"))))
    assert main(["--resume", str(run_dir), "--set", "rollout.max_turns=10", "--dryrun"]) == 0
    script = capsys.readouterr().out
    main_cmd = shlex.split(script[script.index(" -- ") + 4:])
    assert main_cmd[1:6] == ["-m", "megatron_tir.cli", "train", "--resume", str(run_dir)]
    sets = [main_cmd[i + 1] for i, a in enumerate(main_cmd) if a == "--set"]
    assert sets[0] == "rollout.max_turns=10" and re.fullmatch(r"sandbox\.address=tcp://127\.0\.0\.1:[0-9]+", sets[1])

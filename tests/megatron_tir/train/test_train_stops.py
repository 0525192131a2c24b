"""The trainer refuses to learn nothing: a step mostly ended by infrastructure failures, or steps in
a row without an update, stop the run with exit 1 and a one-line cause, and nothing new is saved.
An error that is not the user's input is exit 1 with its traceback in the log (not "bad input").

The runs are in-process (tiny-cpu recipe, one rank, real Learner, real sandbox cluster); only the
engine is scripted (it writes a code block, so every trajectory calls the sandbox)."""

from __future__ import annotations

import json
import logging

import pytest
from scripted_engine import ScriptedEngine

from megatron_tir.cli import main
from megatron_tir.train.checkpoint import RunCheckpoints

QUICK = ["--set", "data.eval_size=0", "--set", "trainer.progress=false", "--set", "rollout.tool_timeout_s=1"]


def writes_code(ctx: str) -> str:
    return "Let me compute.\n```python\nprint(1 + 1)\n```" if "print(1 + 1)\n```" not in ctx else "\\boxed{2}"


@pytest.fixture
def scripted_engine(monkeypatch):
    def build_engine(cfg, *, model_dir=None, settings=None):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        return ScriptedEngine(tok, writes_code), tok

    monkeypatch.setattr("megatron_tir.rollout.factory.build_engine", build_engine)  # the shared assembly builds it
    # the scripted engine has no weights to receive
    monkeypatch.setattr("megatron_tir.train.rollouts.RolloutService.sync_from", lambda self, learner: None)
    monkeypatch.setattr("megatron_tir.train.rollouts.RolloutService.offload", lambda self: None)  # nor memory to free


def run_cli(capsys, *argv):
    """(exit code, the CLI's own lines on stderr: library warnings and progress bars left out)"""
    code = main(list(argv))
    return code, "\n".join(x for x in capsys.readouterr().err.splitlines() if x.startswith("megatron-tir"))


def test_a_sandbox_killed_after_step_1_stops_the_run_and_keeps_its_checkpoint(capsys, monkeypatch, tmp_path,
                                                                             scripted_engine):
    from sandbox_cluster import LocalCluster

    run = tmp_path / "run"
    with LocalCluster(workers=1) as cluster:
        class KillSandboxAfterStep1(RunCheckpoints):
            def save(self, learner, state):
                path = super().save(learner, state)
                if state.step == 1:
                    cluster.close()
                return path

        monkeypatch.setattr("megatron_tir.train.loop.RunCheckpoints", KillSandboxAfterStep1)
        code, err = run_cli(capsys, "train", "--recipe", "tiny-cpu", "--out", str(run), "--set", "trainer.steps=3",
                            "--set", f"sandbox.address={cluster.address}", *QUICK)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1, err
    assert lines[0].startswith("megatron-tir: error: 4 of 4 trajectories of the step were ended by infrastructure "
                               "failures (more than trainer.stop.infra_failure_share=0.5)"), err
    ckpts = run / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_1" and sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_1"]
    assert json.loads((ckpts / "step_1" / "trainer_state.json").read_text())["step"] == 1
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] and rows[0]["rollout/code_trajectory_ratio"] == 1.0  # step 1 ran the code


def test_steps_in_a_row_without_an_update_stop_the_run(capsys, tmp_path):
    run = tmp_path / "run"
    # tiny-cpu's random policy earns no reward: with the zero-std group filter no step has a row to train
    code, err = run_cli(capsys, "train", "--recipe", "tiny-cpu", "--out", str(run), "--set", "trainer.steps=4",
                        "--set", "trainer.filters.drop_zero_std=true", "--set", "trainer.stop.steps_without_update=2",
                        *QUICK)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and "2 steps in a row without an update (last: step 2" in lines[0], err
    assert (run / "checkpoints" / "latest").read_text() == "step_1"  # step 2 stopped before its checkpoint


def test_an_error_mid_run_is_exit_1_with_its_traceback_not_bad_input(capsys, caplog, monkeypatch, tmp_path):
    def broken(*args, **kwargs):
        raise ValueError("a defect, not the user's input")

    monkeypatch.setattr("megatron_tir.train.algorithm.build_update", broken)
    with caplog.at_level(logging.ERROR):
        code, err = run_cli(capsys, "train", "--recipe", "tiny-cpu", "--out", str(tmp_path / "run"), *QUICK)
    assert code == 1 and "bad input" not in err and "error:" not in err
    (record,) = [r for r in caplog.records if r.message.startswith("training failed")]
    assert record.exc_info is not None and "a defect, not the user's input" in str(record.exc_info[1])

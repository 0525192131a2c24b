"""End to end: ``megatron-tir train`` on the tiny-cpu recipe with a real sandbox cluster and the
in-process engine, one process and two (TP=2); resume (same budgets: identical to an
uninterrupted run; 5 -> 10 turns: the new budget), a process killed while saving, plot."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torchrun_testing import assert_one_line_from_rank_0

PY = sys.executable
ROOT = Path(__file__).resolve().parents[3]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def cli(*args, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "megatron_tir.cli", *args], env=ENV, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def metrics(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def state(run: Path) -> dict:
    ck = run / "checkpoints"
    return json.loads((ck / (ck / "latest").read_text() / "trainer_state.json").read_text())


def check_ok(p: subprocess.CompletedProcess) -> None:
    assert p.returncode == 0, p.stderr[-3000:]


def test_two_steps_then_resume_with_ten_turns_then_plot(tmp_path):
    run = tmp_path / "run"
    check_ok(cli("train", "--recipe", "tiny-cpu", "--set", "trainer.steps=2", "--out", str(run)))
    m = metrics(run)
    assert sorted(m) == [0, 1, 2]
    for step in (1, 2):
        # void_turn=stop (tiny-cpu's mode): a void turn ends its trajectory, so the two shares agree
        assert m[step]["rollout/void_turn_ratio"] == m[step]["rollout/void_trajectory_ratio"]
        assert math.isfinite(m[step]["train/grad_norm"]) and m[step]["train/grad_norm"] > 0
        assert m[step]["budget/max_turns"] == 2
    assert "eval/reward" in m[0] and "eval/reward" in m[2]
    assert state(run)["step"] == 2 and state(run)["data_position"] == 4
    assert (run / "config.json").is_file() and list((run / "tb").glob("events.*"))
    # rank 0's train.log starts before the learner is built: its start-up line, then the run's step lines
    log_lines = (run / "train.log").read_text().splitlines()
    ready = [i for i, x in enumerate(log_lines) if " INFO learner ready: tiny-qwen2" in x]
    step2 = [i for i, x in enumerate(log_lines) if "megatron_tir.steps INFO step 2/2 | " in x]
    assert len(ready) == 1 and len(step2) == 1 and ready[0] < step2[0], log_lines[:20]

    check_ok(cli("train", "--resume", str(run), "--set", "trainer.steps=3", "--set", "rollout.max_turns=10"))
    m = metrics(run)
    assert sorted(m) == [0, 1, 2, 3]  # continues at step 3, nothing logged twice
    assert m[3]["budget/max_turns"] == 10
    s = state(run)
    assert s["step"] == 3 and s["data_position"] == 6
    assert {"step": 3, "key": "rollout.max_turns", "value": "10"} in s["overrides"]
    assert json.loads((run / "config.json").read_text())["rollout"]["max_turns"] == 10
    log_text = (run / "train.log").read_text()  # the resume appends: its learner, where it resumed, its step
    assert log_text.count("learner ready: tiny-qwen2") == 2 and log_text.count(f"resumed {run} at step 2 ") == 1
    assert "megatron_tir.steps INFO step 3/3 | " in log_text

    # a requeued job of the finished run (the sbatch resumes whenever there is a checkpoint): exit 0, nothing run
    p = cli("train", "--resume", str(run))
    check_ok(p)
    assert "has done all its 3 steps: nothing to do" in p.stdout and sorted(metrics(run)) == [0, 1, 2, 3]

    p = cli("plot", str(run))
    check_ok(p)
    assert (run / "plots" / "reward.png").is_file() and "reward.png" in p.stdout

    # the policy of a run checkpoint exports to HF with tir-ckpt (the step directory; the run
    # directory, its latest step, is tested with eval in test_run_checkpoint_model_source)
    hf = tmp_path / "hf"
    p = subprocess.run([PY, "-m", "checkpoints_tools.cli", "megatron-to-hf", "--ckpt",
                        str(run / "checkpoints" / "step_3"), "--out", str(hf)], env=ENV,
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    check_ok(p)
    assert (hf / "model.safetensors").is_file() and (hf / "config.json").is_file()


def test_resume_is_identical_to_an_uninterrupted_run(tmp_path):
    """Step count, optimizer state, data position, RNG, the grad-norm statistics (a window of 2:
    step 3's moving average is over steps 1 and 2) and the engine's weight version survive a resume:
    step 3 of a run resumed after step 2 equals step 3 of a run that never stopped."""
    a, b = tmp_path / "a", tmp_path / "b"
    window = ("--set", "trainer.log.moving_average=2")
    check_ok(cli("train", "--recipe", "tiny-cpu", "--set", "trainer.steps=3", *window, "--out", str(a)))
    check_ok(cli("train", "--recipe", "tiny-cpu", "--set", "trainer.steps=2", *window, "--out", str(b)))
    check_ok(cli("train", "--resume", str(b), "--set", "trainer.steps=3"))
    ma, mb = metrics(a), metrics(b)
    assert ma[3]["train/weight_version_max"] == 2  # step 3 sampled with the weights of step 2's sync
    assert state(b)["weight_version"] == 3
    assert ma[3]["train/grad_norm_ma"] == pytest.approx((ma[1]["train/grad_norm"] + ma[2]["train/grad_norm"]) / 2)
    for key in ("train/loss", "train/grad_norm", "rollout/mean_response_tokens", "rollout/reward",
                "train/grad_norm_ma", "train/grad_norm_spike", "train/weight_version_max", "train/weight_version_min"):
        assert key in mb[3], key
        assert mb[3][key] == pytest.approx(ma[3][key], rel=1e-4, abs=1e-6), key


def test_a_filter_that_empties_the_batch_refills_then_skips_the_update(tmp_path):
    """tiny-cpu's random policy earns no reward: every group has zero std, so dynamic sampling
    samples the configured extra rounds, then the step skips the update and the run goes on."""
    run = tmp_path / "run"
    check_ok(cli("train", "--recipe", "tiny-cpu", "--set", "trainer.steps=2", "--set", "trainer.filters.drop_zero_std=true",
                 "--set", "trainer.sampling.max_rounds=2", "--out", str(run)))
    m = metrics(run)
    for step in (1, 2):
        assert m[step]["train/skipped_empty_batch"] == 1.0 and m[step]["filter/sample_rounds"] == 2.0
        assert m[step]["filter/groups_zero_std"] == 4.0 and "train/grad_norm" not in m[step]
    s = state(run)
    assert s["step"] == 2 and s["data_position"] == 8  # 2 steps x 2 rounds x 2 prompts


def test_killed_during_checkpoint_save_then_resumed(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen([PY, "-m", "megatron_tir.cli", "train", "--recipe", "tiny-cpu", "--set",
                             "trainer.steps=3", "--out", str(run)], env=ENV, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tmp = run / "checkpoints" / ".tmp-step_2"
    deadline = time.monotonic() + 600
    while not tmp.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before saving step 2"
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (run / "checkpoints" / "latest").read_text() == "step_1"
    check_ok(cli("train", "--resume", str(run)))
    assert state(run)["step"] == 3 and sorted(metrics(run)) == [0, 1, 2, 3]


def test_two_processes_tensor_parallel(tmp_path):
    run = tmp_path / "run"
    p = subprocess.run([str(Path(PY).parent / "torchrun"), "--standalone", "--nproc-per-node", "2", "-m",
                        "megatron_tir.cli", "train", "--recipe", "tiny-cpu", "--set", "learner.tp=2", "--set",
                        "trainer.steps=2", "--out", str(run)], env=ENV, capture_output=True, text=True, timeout=900,
                       cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    m = metrics(run)
    assert sorted(m) == [0, 1, 2] and all(math.isfinite(m[s]["train/grad_norm"]) for s in (1, 2))
    assert state(run)["step"] == 2
    # INFO lines once (rank 0's; the other rank logs from WARNING up), and in rank 0's train.log
    assert p.stderr.count("learner ready:") == 1 and "tp=2 pp=1 dp=1" in p.stderr, p.stderr[-3000:]
    assert p.stderr.count("step 2/2 | ") == 1, p.stderr[-3000:]
    log_text = (run / "train.log").read_text()
    assert log_text.count("learner ready:") == 1 and log_text.count("step 2/2 | ") == 1, log_text[-3000:]


@pytest.mark.slow
def test_a_bad_config_under_torchrun_is_one_line_from_rank_0(tmp_path):
    """Two ranks with the same bad config: rank 0 says it in one line and exits 2, the other rank says nothing;
    torchrun's report names rank 0 (exit 2) the root cause (torchrun itself exits 1 whenever a rank fails);
    nothing is written."""
    p = subprocess.run([str(Path(PY).parent / "torchrun"), "--standalone", "--nproc-per-node", "2", "-m",
                        "megatron_tir.cli", "train", "--recipe", "tiny-cpu", "--set", "rollout.max_turns=zero",
                        "--out", str(tmp_path / "run")], env=ENV, capture_output=True, text=True, timeout=600,
                       cwd=ROOT)
    assert_one_line_from_rank_0(p, "megatron-tir: error: rollout.max_turns: 'zero' is not an int")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("args,message", [
    (["--recipe", "tiny-cpu"], "--recipe needs --out"),
    (["--recipe", "huge", "--out", "X"], "unknown recipe 'huge'"),
    (["--recipe", "tiny-cpu", "--out", "X", "--set", "rollout.max_turns=zero"], "rollout.max_turns: 'zero' is not an int"),
    (["--resume", "NOPE"], "no config.json"),
])
def test_bad_command_lines_are_one_line_errors(tmp_path, args, message):
    args = [a.replace("X", str(tmp_path / "r")).replace("NOPE", str(tmp_path / "none")) for a in args]
    p = cli("train", *args, timeout=120)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megatron-tir: error:") and message in lines[0], p.stderr

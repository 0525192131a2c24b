"""``megatron-tir sft`` end to end on a tiny model: the loss falls, ``--resume`` continues exactly where an
uninterrupted run is, the run directory is a model for ``train`` and ``eval``; bad input is one line, exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torchrun_testing import assert_one_line_from_rank_0

PY = sys.executable
ROOT = Path(__file__).resolve().parents[3]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}

MESSAGES = [
    [{"role": "user", "content": "What is 12*13?"}, {"role": "assistant", "content": "```python\nprint(12*13)\n```"},
     {"role": "tool", "content": "156"}, {"role": "assistant", "content": "The answer is \\boxed{156}."}],
    [{"role": "user", "content": "What is 7+8?"}, {"role": "assistant", "content": "```python\nprint(7+8)\n```"},
     {"role": "tool", "content": "15"}, {"role": "assistant", "content": "So \\boxed{15}."}],
    [{"role": "user", "content": "What is 2**10?"}, {"role": "assistant", "content": "```python\nprint(2**10)\n```"},
     {"role": "tool", "content": "1024"}, {"role": "assistant", "content": "\\boxed{1024}"}],
]


def cli(*args, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "megatron_tir.cli", *args], env=ENV, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def ok(p: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def metrics(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def _records(path: Path) -> Path:
    """Trajectory records with token ids (collect's format), rendered from MESSAGES."""
    from transformers import AutoTokenizer

    from megatron_tir.model_sources import resolve_model
    from megatron_tir.rollout.driver import RolloutConfig
    from megatron_tir.sft.examples import render_messages

    tok = AutoTokenizer.from_pretrained(resolve_model("tiny-qwen2"))
    with open(path, "w") as f:
        for i, msgs in enumerate(MESSAGES):
            e = render_messages(msgs, tok, RolloutConfig(), where=str(i))
            f.write(json.dumps({"prompt_ids": list(e.prompt_ids), "response_ids": list(e.response_ids),
                                "loss_mask": list(e.loss_mask), "reward": 1.0, "status": "completed"}) + "\n")
    return path


@pytest.mark.slow
def test_sft_then_resume_then_train_and_eval_from_the_run_dir(tmp_path):
    data = _records(tmp_path / "good.jsonl")
    straight, split = tmp_path / "straight", tmp_path / "split"
    common = ("--recipe", "tiny-cpu-sft", "--data", str(data), "--set", "rows_per_step=2")
    ok(cli("sft", *common, "--set", "steps=4", "--out", str(straight)))
    m = metrics(straight)
    assert sorted(m) == [1, 2, 3, 4] and m[4]["train/loss"] < m[1]["train/loss"]
    assert all(r["train/feedback_tokens"] > 0 and r["train/rows"] == 2 for r in m.values())
    assert (straight / "plots" / "loss.png").is_file()

    ok(cli("sft", *common, "--set", "steps=2", "--out", str(split)))
    p = ok(cli("sft", "--resume", str(split), "--set", "steps=4"))
    assert "fine-tuned to step 4" in p.stdout
    assert {s: (r["train/loss"], r["train/grad_norm"]) for s, r in metrics(split).items()} == \
        {s: (r["train/loss"], r["train/grad_norm"]) for s, r in m.items()}  # the same data order and weights
    assert "nothing to do" in ok(cli("sft", "--resume", str(split))).stdout

    rl = tmp_path / "rl"
    ok(cli("train", "--recipe", "tiny-cpu", "--set", f"model={straight}", "--set", "trainer.steps=1",
           "--set", "data.eval_size=0", "--out", str(rl)))
    meta = json.loads((rl / "checkpoints" / "step_1" / "policy" / "tir_ckpt.json").read_text())
    assert meta["source"] == str(straight) and meta["iteration"] == 1

    out = tmp_path / "eval.jsonl"
    ok(cli("eval", "--model", str(straight), "--data", "arithmetic", "--limit", "1", "--k", "1", "--max-turns", "1",
           "--max-response-tokens", "8", "--out", str(out), "--out-tokens", "--no-progress"))
    (record,) = map(json.loads, out.read_text().splitlines())
    # eval --out-tokens records are sft data as they are (this one is not correct: only_correct=False reads it)
    from transformers import AutoTokenizer

    from megatron_tir.model_sources import resolve_model
    from megatron_tir.rollout.driver import RolloutConfig
    from megatron_tir.sft.examples import load_examples

    (example,) = load_examples([out], AutoTokenizer.from_pretrained(resolve_model("tiny-qwen2")), RolloutConfig(),
                               only_correct=False)
    assert list(example.response_ids) == record["response_ids"] and list(example.loss_mask) == record["loss_mask"]


def _one_line_error(p: subprocess.CompletedProcess, *needles: str) -> None:
    assert p.returncode == 2, p.stderr[-2000:]
    line = p.stderr.strip().splitlines()[-1]
    assert line.startswith("megatron-tir: error:") and all(n in line for n in needles), line


@pytest.mark.slow
def test_bad_input_is_one_line(tmp_path):
    _one_line_error(cli("sft", "--recipe", "tiny-cpu-sft", "--data", str(tmp_path / "none.jsonl"),
                        "--out", str(tmp_path / "r0")), "none.jsonl", "no such file")
    (tmp_path / "empty.jsonl").write_text("")
    _one_line_error(cli("sft", "--recipe", "tiny-cpu-sft", "--data", str(tmp_path / "empty.jsonl"),
                        "--out", str(tmp_path / "r1")), "empty.jsonl", "no trajectory")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": MESSAGES[0]}) + "\n" +
                                        json.dumps({"prompt_ids": [1], "response_ids": [2, 3], "loss_mask": [1],
                                                    "reward": 1.0}) + "\n")
    _one_line_error(cli("sft", "--recipe", "tiny-cpu-sft", "--data", str(tmp_path / "bad.jsonl"),
                        "--out", str(tmp_path / "r2")), "bad.jsonl:2", "loss_mask has 1 entries for 2")
    _one_line_error(cli("sft", "--recipe", "tiny-cpu-sft", "--data", str(tmp_path / "bad.jsonl"),
                        "--set", "rows_per_step=0", "--out", str(tmp_path / "r3")), "rows_per_step")


@pytest.mark.slow
def test_a_bad_layout_under_torchrun_is_one_line_from_rank_0(tmp_path):
    """Two ranks, two data-parallel replicas, one row a step: rank 0 says so in one line and exits 2, the other
    rank says nothing; torchrun's report names rank 0 (exit 2) the root cause (torchrun itself exits 1 whenever
    a rank fails, with its ChildFailedError report); nothing is written."""
    data = _records(tmp_path / "good.jsonl")
    p = subprocess.run([str(Path(PY).parent / "torchrun"), "--standalone", "--nproc-per-node", "2", "-m",
                        "megatron_tir.cli", "sft", "--recipe", "tiny-cpu-sft", "--data", str(data),
                        "--set", "rows_per_step=1", "--out", str(tmp_path / "run")],
                       env=ENV, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert_one_line_from_rank_0(p, "megatron-tir: error: rows_per_step=1 is fewer than the 2 data-parallel replicas")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_tensor_parallel_sft_has_the_single_process_losses(tmp_path):
    """Two gloo ranks at TP 2 (the learner's layout through ``--set learner.tp=2``) train the same rows in the
    same order as one process: every step's loss and gradient norm agree (step 2's loss also checks step 1's
    update)."""
    data = _records(tmp_path / "good.jsonl")
    common = ("--recipe", "tiny-cpu-sft", "--data", str(data), "--set", "rows_per_step=2", "--set", "steps=3",
              "--set", "plots=false")
    ok(cli("sft", *common, "--out", str(tmp_path / "one")))
    p = ok(subprocess.run([str(Path(PY).parent / "torchrun"), "--standalone", "--nproc-per-node", "2", "-m",
                           "megatron_tir.cli", "sft", *common, "--set", "learner.tp=2", "--out", str(tmp_path / "tp2")],
                          env=ENV, capture_output=True, text=True, timeout=600, cwd=ROOT))
    assert "tp=2 pp=1 dp=1" in p.stderr  # the learner's "ready" line: the layout really is TP 2
    # INFO lines once (rank 0's; the other rank logs from WARNING up)
    assert p.stderr.count("learner ready:") == 1 and p.stderr.count("sft step 3/3") == 1, p.stderr[-3000:]
    log_file = (tmp_path / "tp2" / "train.log").read_text()  # rank 0's records from before the learner is built
    assert "learner ready: tiny-qwen2" in log_file and "sft data: 3 trajectories" in log_file, log_file
    assert log_file.count("sft step 3/3") == 1
    one, tp2 = metrics(tmp_path / "one"), metrics(tmp_path / "tp2")
    assert sorted(tp2) == sorted(one) == [1, 2, 3]
    for step in one:
        assert tp2[step]["train/loss"] == pytest.approx(one[step]["train/loss"], rel=1e-5), step
        assert tp2[step]["train/grad_norm"] == pytest.approx(one[step]["train/grad_norm"], rel=1e-4), step

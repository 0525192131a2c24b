"""One checkpoint layout: a run directory (or one of its step directories) is a model everywhere.

``megatron-tir train`` (tiny-cpu, 1 step) -> ``tir-ckpt megatron-to-hf --ckpt RUN_DIR`` (its
latest step) and ``--ckpt RUN_DIR/checkpoints/step_1`` give the same HF weights, the trained
ones -> ``megatron-tir eval`` on that HF directory, and on the run directory itself, sample the
same tokens -> a Learner and a new ``train --set model=RUN_DIR`` start from those weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

PY = sys.executable
ROOT = Path(__file__).resolve().parents[3]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _run(*args, timeout=600) -> subprocess.CompletedProcess:
    p = subprocess.run([PY, "-m", *args], env=ENV, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def _eval(model: str, data: Path, out: Path) -> list[dict]:
    _run("megatron_tir.cli", "eval", "--model", model, "--data", str(data), "--k", "2", "--max-turns", "1",
         "--max-response-tokens", "8", "--out", str(out), "--no-progress")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    return sorted(rows, key=lambda r: (r["group_id"], r["sample_index"]))


@pytest.mark.slow
def test_train_then_tir_ckpt_on_the_run_dir_then_eval_then_train_from_it(tmp_path):
    from megatron_tir.model_sources import resolve_model

    run = tmp_path / "run"
    _run("megatron_tir.cli", "train", "--recipe", "tiny-cpu", "--set", "trainer.steps=1", "--out", str(run))
    assert (run / "checkpoints" / "latest").read_text() == "step_1"

    hf, hf_step = tmp_path / "hf", tmp_path / "hf-step"
    _run("checkpoints_tools.cli", "megatron-to-hf", "--ckpt", str(run), "--out", str(hf))
    _run("checkpoints_tools.cli", "megatron-to-hf", "--ckpt", str(run / "checkpoints" / "step_1"), "--out", str(hf_step))
    trained, again = load_file(hf / "model.safetensors"), load_file(hf_step / "model.safetensors")
    base = load_file(resolve_model("tiny-qwen2") / "model.safetensors")
    assert trained.keys() == again.keys() == base.keys()
    assert all(torch.equal(trained[n], again[n]) for n in trained)
    assert any(not torch.equal(trained[n], base[n]) for n in trained)  # one step moved the weights

    data = tmp_path / "two.parquet"
    pd.DataFrame({"prompt": [[{"role": "user", "content": "What is 1+1?"}],
                             [{"role": "user", "content": "What is 2+3?"}]],
                  "reward_model": [{"ground_truth": "2"}, {"ground_truth": "5"}],
                  "data_source": ["unit", "unit"]}).to_parquet(data)
    from_hf = _eval(str(hf), data, tmp_path / "hf.jsonl")
    from_run = _eval(str(run), data, tmp_path / "run.jsonl")
    assert len(from_hf) == 4 and [r["response"] for r in from_hf] == [r["response"] for r in from_run]

    # a Learner built from the run directory holds exactly those weights
    from megatron_tir.policy.learner import Learner
    from megatron_tir.policy.learner_config import LearnerConfig
    from megatron_tir.policy.parallel import destroy_parallel, init_parallel

    init_parallel(1, 1)
    try:
        learner = Learner(LearnerConfig(model=str(run)))
        weights = {n: t.clone() for bucket in learner.hf_weights(1 << 30) for n, t in bucket}
    finally:
        destroy_parallel()
    assert weights.keys() == trained.keys() and all(torch.equal(weights[n], trained[n]) for n in trained)

    # a new run starts from the run directory's weights
    second = tmp_path / "second"
    _run("megatron_tir.cli", "train", "--recipe", "tiny-cpu", "--set", f"model={run}", "--set", "trainer.steps=1",
         "--out", str(second))
    meta = json.loads((second / "checkpoints" / "step_1" / "policy" / "tir_ckpt.json").read_text())
    assert meta["source"] == str(run) and meta["iteration"] == 1

"""The Algorithm seam: the loop takes whatever ``trainer.ppo.algorithm`` names -- a family of the registry
or a class of your own by import path -- and a bad name is one line before anything is built."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_tir.train.algorithm import ALGORITHMS, CriticPPO, PolicyGradient, algorithm_class
from megatron_tir.train.config import ALGORITHM_NAMES, apply_overrides
from megatron_tir.train.recipes import tiny_cpu

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


def test_the_config_names_the_registry():
    assert set(ALGORITHM_NAMES) == {"auto", *ALGORITHMS}


def test_auto_is_the_estimators_family_and_a_mismatch_is_refused():
    assert algorithm_class(tiny_cpu()) is PolicyGradient
    assert algorithm_class(apply_overrides(tiny_cpu(), ["trainer.ppo.advantage=gae"])) is CriticPPO
    with pytest.raises(ValueError, match="does not match trainer.ppo.advantage=grpo"):
        algorithm_class(apply_overrides(tiny_cpu(), ["trainer.ppo.algorithm=critic_ppo"]))
    with pytest.raises(ValueError, match="algorithm must be one of auto, policy_gradient, critic_ppo or an import"):
        apply_overrides(tiny_cpu(), ["trainer.ppo.algorithm=ppo2"])
    with pytest.raises(ValueError, match="trainer.ppo.algorithm: cannot import 'no_such_module'"):
        algorithm_class(apply_overrides(tiny_cpu(), ["trainer.ppo.algorithm=no_such_module:X"]))


@pytest.mark.slow  # one tiny-cpu step in its own process (~40 s)
def test_an_algorithm_from_a_test_module_runs_a_step(tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{HERE}", "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "megatron_tir.cli", "train", "--recipe", "tiny-cpu",
                        "--set", "trainer.steps=1", "--set", "data.eval_size=0", "--set", "trainer.progress=false",
                        "--set", "trainer.ppo.algorithm=toy_algorithm:ClippedAdvantages", "--out", str(run)],
                       env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    (line,) = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert line["toy/mini_batches"] == line["train/optimizer_steps"] >= 1
    assert "toy/clipped_tokens" in line and line["train/grad_norm"] > 0

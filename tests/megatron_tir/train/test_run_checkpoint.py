"""Run checkpoints: atomic save, keep_last pruning, named learners, a process killed mid-save leaves
the previous one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_tir.train.checkpoint import RunCheckpoints, TrainerState

HERE = Path(__file__).parent


class ModuleLearner:
    """A learner-shaped object over a torch module + Adam, saved and loaded by ``save`` / ``load``
    below (the run checkpoints' ``save_learner`` / ``load_learner``)."""

    def __init__(self, seed: int = 0, slow_save_s: float = 0.0) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Linear(4, 4)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=0.1)
        self.slow_save_s = slow_save_s

    def train_step(self) -> None:
        self.opt.zero_grad()
        self.model(torch.ones(2, 4)).pow(2).sum().backward()
        self.opt.step()

    def save(self, directory) -> None:
        Path(directory).mkdir(parents=True)
        torch.save(self.model.state_dict(), Path(directory) / "model.pt")
        if self.slow_save_s:
            (Path(directory) / "started").touch()
            time.sleep(self.slow_save_s)
        torch.save(self.opt.state_dict(), Path(directory) / "optim.pt")

    def load(self, directory) -> None:
        self.model.load_state_dict(torch.load(Path(directory) / "model.pt"))
        self.opt.load_state_dict(torch.load(Path(directory) / "optim.pt"))


def _checkpoints(run_dir, keep_last: int) -> RunCheckpoints:
    return RunCheckpoints(run_dir, keep_last=keep_last, save_learner=ModuleLearner.save,
                          load_learner=ModuleLearner.load)


def test_save_load_restores_learner_state_rng_and_prunes(tmp_path):
    ck = _checkpoints(tmp_path, keep_last=2)
    assert ck.latest() is None
    learner = ModuleLearner()
    for step in (1, 2, 3):
        learner.train_step()
        ck.save({"policy": learner}, TrainerState(step=step, data_position=8 * step, config={"model": "x"}))
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_2", "step_3"]
    assert ck.latest().name == "step_3"
    expected_w = learner.model.weight.detach().clone()
    after_rng = torch.rand(3)  # the RNG draw right after the save
    learner.train_step()
    other = ModuleLearner(seed=1)
    state = ck.load({"policy": other})
    assert (state.step, state.data_position, state.config) == (3, 24, {"model": "x"})
    torch.testing.assert_close(other.model.weight, expected_w)
    torch.testing.assert_close(torch.rand(3), after_rng)
    assert other.opt.state_dict()["state"][0]["step"] == 3


def test_process_killed_during_save_leaves_previous_checkpoint(tmp_path):
    script = f"""
import sys, time
sys.path.insert(0, {str(HERE)!r})
from test_run_checkpoint import ModuleLearner
from megatron_tir.train.checkpoint import RunCheckpoints, TrainerState
ck = RunCheckpoints({str(tmp_path)!r}, keep_last=1, save_learner=ModuleLearner.save, load_learner=ModuleLearner.load)
learner = ModuleLearner()
learner.train_step()
ck.save({{"policy": learner}}, TrainerState(step=1, data_position=4))
learner.slow_save_s = 60
learner.train_step()
ck.save({{"policy": learner}}, TrainerState(step=2, data_position=8))
"""
    proc = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": os.getcwd()})
    started = tmp_path / "checkpoints" / ".tmp-step_2" / "policy" / "started"
    deadline = time.monotonic() + 60
    while not started.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the saving process ended early"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    ck = _checkpoints(tmp_path, keep_last=1)
    assert ck.latest().name == "step_1"
    fresh = ModuleLearner(seed=5)
    state = ck.load({"policy": fresh})
    assert (state.step, state.data_position) == (1, 4)
    # the next save clears the partial one and prunes step_1 (keep_last=1)
    ck.save({"policy": fresh}, TrainerState(step=2, data_position=8))
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step_2"]
    assert json.loads((tmp_path / "checkpoints" / "step_2" / "trainer_state.json").read_text())["step"] == 2


def test_latest_naming_an_incomplete_checkpoint_is_an_error(tmp_path):
    (tmp_path / "checkpoints" / "step_4").mkdir(parents=True)
    (tmp_path / "checkpoints" / "latest").write_text("step_4")
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        RunCheckpoints(tmp_path, keep_last=1).latest()


def test_named_learners_are_saved_and_loaded_each_by_name(tmp_path):
    ck = _checkpoints(tmp_path, keep_last=1)
    policy, critic = ModuleLearner(seed=0), ModuleLearner(seed=1)
    policy.train_step()
    ck.save({"policy": policy, "critic": critic}, TrainerState(step=1))
    step = tmp_path / "checkpoints" / "step_1"
    assert (step / "policy" / "model.pt").is_file() and (step / "critic" / "model.pt").is_file()
    new_policy, new_critic = ModuleLearner(seed=2), ModuleLearner(seed=3)
    ck.load({"policy": new_policy, "critic": new_critic})
    torch.testing.assert_close(new_policy.model.weight, policy.model.weight)
    torch.testing.assert_close(new_critic.model.weight, critic.model.weight)
    assert not torch.equal(policy.model.weight, critic.model.weight)
    with pytest.raises(ValueError, match="has no learner 'value'"):
        ck.load({"value": ModuleLearner()})
    with pytest.raises(ValueError, match="by name"):
        ck.save(policy, TrainerState(step=2))
    with pytest.raises(ValueError, match="learner name"):
        ck.save({"../x": policy}, TrainerState(step=2))

"""``run_sft`` reads and checks its data before anything expensive: a malformed row is refused with the
one line naming its file and row before the process group is set up and the learner (the model) is built."""

from __future__ import annotations

import json

import pytest

import megatron_tir.policy.learner as learner_module
import megatron_tir.policy.parallel as parallel
from megatron_tir.sft.config import tiny_cpu_sft
from megatron_tir.sft.loop import run_sft
from megatron_tir.train.checkpoint import TrainerState


def test_a_malformed_row_is_refused_before_the_process_group_and_the_learner(tmp_path, monkeypatch):
    built: list[str] = []
    monkeypatch.setattr(parallel, "init_parallel", lambda *a, **k: built.append("process group"))
    monkeypatch.setattr(parallel, "destroy_parallel", lambda: None)
    monkeypatch.setattr(learner_module, "Learner", lambda *a, **k: built.append("learner"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt_ids": [1], "response_ids": [2, 3], "loss_mask": [1, 1], "reward": 1.0}) + "\n"
                   + json.dumps({"prompt_ids": [1], "response_ids": [2, 3], "loss_mask": [1], "reward": 1.0}) + "\n")
    cfg = tiny_cpu_sft()
    cfg.data = (str(bad),)
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: .*loss_mask has 1 entries for 2") as err:
        run_sft(cfg, tmp_path / "run", TrainerState(), resume=False)
    assert "\n" not in str(err.value)
    assert built == []

"""What ``megatron-tir train`` says at start: the keys a resume's --set changed, a loaded machine."""

from __future__ import annotations

from megatron_tir.train.config import apply_overrides, to_dict
from megatron_tir.train.recipes import load_recipe


def test_config_changes_name_each_changed_key_old_and_new():
    from megatron_tir.train.cli import config_changes

    before = to_dict(load_recipe("tiny-cpu"))
    after = to_dict(apply_overrides(load_recipe("tiny-cpu"),
                                    ["rollout.max_turns=10", "trainer.async=one_step", "data.eval_top_p=0.7"]))
    assert config_changes(before, after) == ["rollout.max_turns 2 -> 10", "data.eval_top_p null -> 0.7",
                                             'trainer.asynchrony.mode "off" -> "one_step"']
    assert config_changes(before, before) == []


def test_a_loaded_machine_is_named_at_start():
    from megatron_tir.train.cli import load_note

    assert load_note(1.9, 2) is None and load_note(2.0, 2) is None
    assert load_note(40.2, 2).startswith("this machine is loaded (load average 40.2 on 2 cores)")

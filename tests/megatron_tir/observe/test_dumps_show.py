"""Rollout dumps: what the update did with each row (and the rule that dropped it), the gzip JSONL
round trip through ``megatron-tir show``, and the rendering of masked spans."""

from __future__ import annotations

import pytest
from observe_crafted import answer_turn, code_turn, make, void_turn

from megatron_tir.cli import main
from megatron_tir.observe.dumps import dump_path, read_dump, step_records, update_records, write_dump
from megatron_tir.observe.show import MASKED, TRAINED, parse_filters, parse_rendering, render, select
from megatron_tir.rl import MODES, needs_values
from megatron_tir.rollout.batch import Group, collate
from megatron_tir.rollout.trajectory import FinishStatus
from megatron_tir.train.batch import plan_update
from megatron_tir.train.producer import row_fates as producer_fates
from megatron_tir.train.sampling import Collected, group_rules


class CharTokenizer:
    """Decodes ids as characters: enough for a record's prompt/response text."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(32 + i % 90) for i in ids)


def _right(g, s):
    return make([code_turn(0, "print(6*7)", stdout="42\n"), answer_turn(1, "so \\boxed{42}", "42")],
                group=g, sample=s, reward=1.0, final_answer="42")


def _wrong(g, s, status=FinishStatus.COMPLETED):
    return make([answer_turn(0, "\\boxed{41}", "41")], group=g, sample=s, reward=0.0, status=status,
                final_answer="41")


def _void(g, s):
    return make([void_turn(0, "```python\nx = (")], group=g, sample=s, reward=0.0, status=FinishStatus.VOID,
                void_reason="length cut inside a code block (partial code)")


def _groups():
    mixed = Group(group_id=0, problem=None, trajectories=[
        _right(0, 0), _void(0, 1), _wrong(0, 2, FinishStatus.TRUNCATED), _wrong(0, 3, FinishStatus.TOOL_FAILED)])
    all_wrong = Group(group_id=1, problem=None, trajectories=[_wrong(1, 0), _wrong(1, 1)])
    surplus = Group(group_id=2, problem=None, trajectories=[_right(2, 0), _wrong(2, 1)])
    return mixed, all_wrong, surplus


FILTERS = dict(drop_zero_std=True, accuracy_lo=0.0, accuracy_hi=1.0)


def row_fates(sampled, kept, *, mode, advantage, overlong, drop_zero_std, accuracy_lo, accuracy_hi, min_rows=1):
    """The trainer's decisions for a step that kept ``kept`` of ``sampled``, in the dump's words: the group
    filter's rule of each group left out (``surplus`` when it passed), the update plan of the kept ones, put
    together as rank 0's producer does (``row_fates``)."""
    rules = group_rules(sampled, drop_zero_std=drop_zero_std, accuracy_lo=accuracy_lo, accuracy_hi=accuracy_hi,
                        overlong=overlong, min_rows=min_rows)
    left_out = {g.group_id: rule or "surplus" for g, rule in zip(sampled, rules) if all(g is not k for k in kept)}
    collected = Collected(groups=list(kept), sampled=list(sampled), rounds=1, removed={}, rules=left_out)
    plan = plan_update(collate(kept, pad_id=0), mode=mode, advantage=None if needs_values(advantage) else advantage,
                       overlong=overlong, mini_batches=1) if kept else None
    return update_records(sampled, producer_fates(collected, plan), drop_void=MODES[mode].drop_void, overlong=overlong)


def test_each_row_says_what_the_update_did_and_why_not():
    mixed, all_wrong, surplus = _groups()
    fates = row_fates([mixed, all_wrong, surplus], [mixed], mode="simpletir", advantage="grpo", overlong="mask",
                      **FILTERS)
    assert fates[(0, 0)]["in_loss"] and fates[(0, 0)]["dropped_by"] is None
    # group 0's counted rewards: 1, 0, 0 (the tool_failed row does not count): mean 1/3, std sqrt(1/3)
    assert fates[(0, 0)]["advantage"] == pytest.approx((1 - 1 / 3) / (1 / 3) ** 0.5, rel=1e-4)
    assert fates[(0, 1)] == {"in_stats": True, "in_loss": False, "advantage": pytest.approx(fates[(0, 1)]["advantage"]),
                             "dropped_by": "void: length cut inside a code block (partial code)"}
    assert fates[(0, 2)]["dropped_by"] == "over-long" and fates[(0, 2)]["in_stats"]
    assert fates[(0, 3)]["dropped_by"] == "infrastructure: tool_failed" and not fates[(0, 3)]["in_stats"]
    assert fates[(1, 0)]["dropped_by"] == "group filter: zero_std" and fates[(1, 0)]["advantage"] is None
    assert fates[(2, 1)]["dropped_by"] == "group filter: surplus"
    keep = row_fates([mixed], [mixed], mode="stop_without_filter", advantage="grpo",
                     overlong="keep", **FILTERS)
    assert keep[(0, 1)]["in_loss"] and keep[(0, 2)]["in_loss"]  # void and over-long rows kept by this mode
    narrow = row_fates([surplus], [], mode="simpletir", advantage="grpo", overlong="mask", drop_zero_std=True,
                       accuracy_lo=0.9, accuracy_hi=1.0)
    assert narrow[(2, 0)]["dropped_by"] == "group filter: accuracy"
    # the group filter's row count (min_group_rows): group 0 has 3 counted rows (tool_failed does not count)
    short = row_fates([mixed], [], mode="simpletir", advantage="grpo", overlong="mask", min_rows=4, **FILTERS)
    assert {f["dropped_by"] for f in short.values()} == {"group filter: no_counted_rows"}
    assert row_fates([mixed], [], mode="simpletir", advantage="grpo", overlong="mask", min_rows=3,
                     **FILTERS)[(0, 0)]["dropped_by"] == "group filter: surplus"
    gae = row_fates([mixed], [mixed], mode="simpletir", advantage="gae", overlong="mask", **FILTERS)
    assert gae[(0, 0)] == {"in_stats": True, "in_loss": True, "advantage": None, "dropped_by": None}


def test_dump_round_trip_through_show(tmp_path, capsys):
    mixed, all_wrong, surplus = _groups()
    fates = row_fates([mixed, all_wrong], [mixed], mode="simpletir", advantage="grpo", overlong="mask", **FILTERS)
    records = step_records(3, "train", [mixed, all_wrong], CharTokenizer(), include_ids=True, fates=fates)
    records += step_records(3, "eval", [surplus], CharTokenizer(), include_ids=False)
    write_dump(dump_path(tmp_path, 3), records)
    back = read_dump(dump_path(tmp_path, 3))
    assert back == records and len(back) == 8
    assert back[0]["loss_mask"] == [1, 1, 1, 0, 0, 1, 1, 1] and "response_ids" in back[0]  # ids on request
    assert "response_ids" not in back[-1] and "update" not in back[-1]  # a held-out row: no update record
    assert {"prompt", "response", "turns", "status", "reward"} <= set(back[0])  # the eval --out record

    assert main(["show", str(tmp_path), "--filter", "void", "--color", "never"]) == 0
    out = capsys.readouterr().out
    assert "1 of 1 matching trajectories of step 3" in out
    assert "NOT IN LOSS (void: length cut inside a code block (partial code))" in out
    assert main(["show", str(tmp_path), "--step", "3", "--filter", "dropped", "--limit", "0"]) == 0
    assert "5 of 5 matching" in capsys.readouterr().out  # void, over-long, tool_failed, two zero_std rows
    assert main(["show", str(tmp_path), "--step", "4"]) == 2
    assert "no dump of step 4" in capsys.readouterr().err
    assert main(["show", str(tmp_path), "--filter", "nonsense"]) == 2


def test_masked_spans_render_differently():
    mixed, _, _ = _groups()
    fates = row_fates([mixed], [mixed], mode="simpletir", advantage="grpo", overlong="mask", **FILTERS)
    right, void = step_records(1, "train", [mixed], CharTokenizer(), include_ids=False, fates=fates)[:2]
    parsed = parse_rendering(render(right))
    assert parsed["trained"] == ["```python", "print(6*7)", "```", "so \\boxed{42}"]  # the model's tokens
    assert parsed["masked"] == ["Code Execution Result: 42"]  # the tool feedback (loss mask 0)
    assert "in loss, advantage +" in parsed["headers"][0]
    dropped = parse_rendering(render(void))
    assert dropped["trained"] == [] and dropped["masked"] == ["```python", "x = ("]  # a dropped row: all masked
    colored = render(right, color=True)
    assert f"\x1b[2m{MASKED}Code Execution Result: 42\x1b[0m" in colored and f"{TRAINED}print(6*7)" in colored
    assert "\x1b" not in render(right)


def test_filters():
    recs = [{"status": "void", "reward": 0, "split": "train", "update": {"in_loss": False}},
            {"status": "completed", "reward": 1, "split": "eval", "update": None}]
    assert select(recs, parse_filters("void")) == recs[:1]
    assert select(recs, parse_filters("correct,eval")) == recs[1:]
    with pytest.raises(ValueError, match="unknown filter"):
        parse_filters("bogus")


def test_show_reads_an_eval_out_file(tmp_path, capsys):
    import json

    _, _, surplus = _groups()
    rec = step_records(0, "eval", [surplus], CharTokenizer(), include_ids=False)[0]
    for key in ("step", "split"):  # what `eval --out` writes: the record without the dump's fields
        rec.pop(key)
    path = tmp_path / "eval.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    assert main(["show", str(path), "--color", "never"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("== group 2 sample 0 · status completed · reward 1.0") and f"{TRAINED}print(6*7)" in out
    (tmp_path / "bad.jsonl").write_text("not json\n")
    assert main(["show", str(tmp_path / "bad.jsonl")]) == 2


def test_a_row_the_eval_filter_kept_out_says_its_rule():
    """The per-row eval filter (``trainer.filters.drop_verifier_failures``): the row stays in its group's
    statistics, leaves the loss, and its dump names the filter's rule (not "no model tokens")."""
    import torch

    from megatron_tir.train.row_filter import eval_filter_rules

    group = Group(group_id=0, problem=None, trajectories=[_right(0, 0), _wrong(0, 1), _wrong(0, 2)])
    group.trajectories[2].reward_failed = True  # the verifier failed on it
    rules = eval_filter_rules(group.trajectories, max_repeat_score=None, drop_verifier_failures=True)
    assert rules == [None, None, "verifier_failed"]
    plan = plan_update(collate([group], pad_id=0), mode="simpletir", advantage="grpo", overlong="mask",
                       mini_batches=1, excluded_B=torch.tensor([r is not None for r in rules]))
    collected = Collected(groups=[group], sampled=[group], rounds=1, removed={}, rules={})
    recs = update_records([group], producer_fates(collected, plan, rules), drop_void=True, overlong="mask")
    assert recs[(0, 2)]["in_stats"] and not recs[(0, 2)]["in_loss"]
    assert recs[(0, 2)]["dropped_by"] == "eval filter: verifier_failed"
    assert recs[(0, 1)]["in_loss"] and recs[(0, 1)]["dropped_by"] is None

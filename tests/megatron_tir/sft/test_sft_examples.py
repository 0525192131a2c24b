"""Trajectory files for ``megatron-tir sft``: records with token ids, messages rendered by the rollout
protocol, one-line errors naming the file and row; the rows of a batch; collect's selection."""

from __future__ import annotations

import gzip
import json

import pytest

from megatron_tir.rollout.driver import RolloutConfig
from megatron_tir.rollout.engines.base import FinishReason
from megatron_tir.rollout.trajectory import FinishStatus, ToolCall, Trajectory, Turn
from megatron_tir.sft.collect import select
from megatron_tir.sft.examples import Example, load_examples, render_messages
from megatron_tir.sft.loop import DataOrder, fit_examples, sft_batch
from megatron_tir.tir.markup import TurnKind


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from megatron_tir.model_sources import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("tiny-qwen2"))


def _record(prompt, response, mask, reward=1.0, **extra):
    return {"prompt_ids": prompt, "response_ids": response, "loss_mask": mask, "reward": reward, "status": "completed",
            **extra}


def _write_jsonl(path, rows, *, gz=False):
    text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


def test_records_with_ids_are_read_as_they_are_and_only_correct_ones_kept(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "d.jsonl.gz", [_record([1, 2], [3, 4, 5], [1, 0, 1]),
                                                  _record([6], [7, 8], [1, 1], reward=0.0),
                                                  _record([9], [10], [1], reward=None)], gz=True)
    got = load_examples([path], tokenizer, RolloutConfig())
    assert [(e.prompt_ids, e.response_ids, e.loss_mask) for e in got] == [((1, 2), (3, 4, 5), (1, 0, 1))]
    assert got[0].where == f"{path}:1"
    assert len(load_examples([path], tokenizer, RolloutConfig(), only_correct=False)) == 3


@pytest.mark.parametrize("rows, message", [
    ([], "no trajectory with reward > 0"),
    (["{not json"], ":1: not JSON"),
    ([_record([1], [2], [1]), "[1, 2]"], ":2: expected a JSON object"),
    ([_record([1], [2, 3], [1])], ":1: loss_mask has 1 entries for 2 response_ids"),
    ([_record([1], [2], [2])], ":1: loss_mask must be a list of 0 / 1"),
    ([_record([], [2], [1])], ":1: prompt_ids is empty"),
    ([_record([1], [-2], [1])], ":1: response_ids must be a list of token ids"),
    ([{"response": "x", "turns": [], "reward": 1.0}], ":1: a trajectory record without token ids"),
    ([{"question": "x"}], ":1: neither a trajectory record"),
    ([{"messages": [{"role": "user", "content": "q"}]}], ":1: messages have no assistant message"),
    ([{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                    {"role": "tool", "content": "1"}]}], ":1: the last message is 'tool'"),
    ([{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": 3}]}],
     ":1: message 1 needs string 'role' and 'content'"),
])
def test_bad_input_is_one_line_naming_the_file_and_row(tmp_path, tokenizer, rows, message):
    path = _write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ValueError) as err:
        load_examples([path], tokenizer, RolloutConfig())
    text = str(err.value)
    assert "\n" not in text and str(path) in text and message in text, text


def test_a_missing_or_unknown_file_is_named(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="no such file"):
        load_examples([tmp_path / "nope.jsonl"], tokenizer, RolloutConfig())
    (tmp_path / "x.csv").write_text("a")
    with pytest.raises(ValueError, match=r"x\.csv: not a \.jsonl"):
        load_examples([tmp_path / "x.csv"], tokenizer, RolloutConfig())
    (tmp_path / "broken.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match="broken.parquet: not a readable parquet file"):
        load_examples([tmp_path / "broken.parquet"], tokenizer, RolloutConfig())


def test_messages_are_rendered_as_a_rollout_lays_them_out(tokenizer):
    from megatron_tir.tir.feedback import FeedbackConfig, format_feedback
    from megatron_tir.tir.prompt import PromptConfig, build_prompt_ids

    rollout = RolloutConfig(prompt=PromptConfig(mode="chat"))
    turn1, turn2 = "Compute it.\n```python\nprint(6*7)\n```", "So \\boxed{42}."
    msgs = [{"role": "user", "content": "What is 6*7?"}, {"role": "assistant", "content": turn1},
            {"role": "tool", "content": "42\n"}, {"role": "assistant", "content": turn2}]
    ex = render_messages(msgs, tokenizer, rollout, where="w")

    class Ok:
        status, stdout, stderr, exit_code, stdout_truncated = "ok", "42\n", "", 0, False
    feedback = format_feedback(Ok(), FeedbackConfig(), timeout=10.0, memory_mb=1024, leading_newline=True)
    assert feedback.startswith("\nCode Execution Result:\n```output\n42\n```")  # the driver's text
    expect_prompt = build_prompt_ids(msgs[:1], rollout.prompt, tokenizer, tools=True)
    a1, fb = tokenizer.encode(turn1, add_special_tokens=False), tokenizer.encode(feedback, add_special_tokens=False)
    a2 = tokenizer.encode(turn2, add_special_tokens=False) + [tokenizer.eos_token_id]
    assert list(ex.prompt_ids) == expect_prompt
    assert list(ex.response_ids) == a1 + fb + a2
    assert list(ex.loss_mask) == [1] * len(a1) + [0] * len(fb) + [1] * len(a2)
    # a tool message that already is feedback (an exported trajectory) is taken as it is
    again = render_messages(msgs[:2] + [{"role": "tool", "content": feedback}] + msgs[3:], tokenizer, rollout, where="w")
    assert again == ex


def test_messages_of_the_simpletir_protocol_get_its_feedback(tokenizer):
    from megatron_tir.tir import simpletir

    rollout = RolloutConfig(protocol="simpletir", max_turns=5)
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "```python\nprint(1)\n```"},
            {"role": "tool", "content": "1\n"}, {"role": "assistant", "content": "\\boxed{1}"}]
    ex = render_messages(msgs, tokenizer, rollout, where="w")

    class Ok:
        status, stdout, stderr, exit_code, stdout_truncated = "ok", "1\n", "", 0, False
    fb = tokenizer.encode(simpletir.format_feedback(Ok(), turn_index=0, max_turns=5), add_special_tokens=False)
    a1 = tokenizer.encode(msgs[1]["content"], add_special_tokens=False)
    assert list(ex.response_ids[len(a1):len(a1) + len(fb)]) == fb
    assert list(ex.loss_mask[len(a1):len(a1) + len(fb)]) == [0] * len(fb)


def test_a_parquet_of_messages(tmp_path, tokenizer):
    import pandas as pd

    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "\\boxed{1}"}]
    pd.DataFrame({"messages": [msgs, msgs]}).to_parquet(tmp_path / "m.parquet")
    got = load_examples([tmp_path / "m.parquet"], tokenizer, RolloutConfig())
    assert len(got) == 2 and got[1].where.endswith("m.parquet: row 1")
    pd.DataFrame({"prompt": ["x"]}).to_parquet(tmp_path / "p.parquet")
    with pytest.raises(ValueError, match="p.parquet: no 'messages' column"):
        load_examples([tmp_path / "p.parquet"], tokenizer, RolloutConfig())


def test_batch_rows_carry_the_mask_after_the_prompt_and_long_rows_are_cut():
    a = Example(prompt_ids=(5, 6), response_ids=(7, 8, 9), loss_mask=(1, 0, 1), where="a")
    b = Example(prompt_ids=(1,), response_ids=(2,), loss_mask=(1,), where="b")
    batch = sft_batch([a, b])
    assert batch.tokens_BT.tolist() == [[5, 6, 7, 8, 9], [1, 2, 0, 0, 0]]
    assert batch.attention_mask_BT.tolist() == [[True] * 5, [True, True, False, False, False]]
    assert batch.loss_mask_BT.tolist() == [[0, 0, 1, 0, 1], [0, 1, 0, 0, 0]]
    fitted, cut, dropped = fit_examples([a, b, Example(prompt_ids=(1, 2, 3), response_ids=(4,), loss_mask=(1,), where="c"),
                                         Example(prompt_ids=(1,), response_ids=(2,), loss_mask=(0,), where="d")], 3)
    assert (cut, dropped) == (1, 2) and fitted[0].response_ids == (7,) and fitted[0].loss_mask == (1,)


def test_data_order_is_a_seeded_permutation_per_epoch():
    order = DataOrder(5, seed=3)
    first, second = order.take(0, 5), order.take(5, 5)
    assert sorted(first) == sorted(second) == list(range(5)) and first != second
    assert DataOrder(5, seed=3).take(3, 4) == (first + second)[3:7]  # a pure function of the position


def _traj(group, sample, ids, *, reward=1.0, status=FinishStatus.COMPLETED, calls=1):
    t = Trajectory(group_id=group, sample_index=sample, prompt_ids=[1], status=status, reward=reward)
    t.append_model_tokens(list(ids), [0.0] * len(ids), [0] * len(ids))
    for i in range(calls):
        t.turns.append(Turn(index=i, kind=TurnKind.CODE, reason="", finish_reason=FinishReason.STOP, start=0,
                            model_tokens=1, code="print(1)", tool=ToolCall(result=None, status="ok")))
    t.turns.append(Turn(index=calls, kind=TurnKind.ANSWER, reason="", finish_reason=FinishReason.EOS, start=0,
                        model_tokens=1))
    return t


def test_collect_keeps_correct_completed_tool_using_trajectories_once_each():
    trajs = [_traj(0, 0, [1, 2]), _traj(0, 1, [1, 2]), _traj(0, 2, [1, 3]), _traj(0, 3, [4], reward=0.0),
             _traj(1, 0, [1, 2]), _traj(1, 1, [5], calls=0), _traj(1, 2, [6], status=FinishStatus.TRUNCATED),
             _traj(2, 0, [7]), _traj(2, 1, [8]), _traj(2, 2, [9])]
    kept, counts = select(trajs, min_tool_calls=1, max_per_prompt=2)
    assert [(t.group_id, t.sample_index) for t in kept] == [(0, 0), (0, 2), (1, 0), (2, 0), (2, 1)]
    assert counts == {"duplicates": 1, "too_few_tool_calls": 1, "capped": 1}
    kept, _ = select(trajs, min_tool_calls=0, max_per_prompt=None)
    assert (1, 1) in [(t.group_id, t.sample_index) for t in kept]

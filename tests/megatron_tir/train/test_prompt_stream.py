"""The generated arithmetic task and the resumable prompt stream."""

from __future__ import annotations

import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_tir.data.arithmetic import HELD_OUT, TRAIN, arithmetic_problem, arithmetic_problems
from megatron_tir.train.config import DataConfig
from megatron_tir.train.data import PromptStream, held_out_problems


def _compute(question: str) -> int:
    expr = re.search(r"Compute (.+?)\. ", question).group(1)
    terms = [[int(x) for x in prod.split(" * ")] for prod in expr.split(" + ")]
    total = 0
    for factors in terms:
        p = 1
        for f in factors:
            p *= f
        total += p
    return total


def test_problems_are_deterministic_correct_and_splits_disjoint():
    train = arithmetic_problems(50, split=TRAIN, digits=4, terms=3)
    assert train == arithmetic_problems(50, split=TRAIN, digits=4, terms=3)
    for p in train:
        q = p.messages[0]["content"]
        assert int(p.ground_truth) == _compute(q) and "final_answer()" in q
        assert all(len(n) == 4 for n in re.findall(r"\d+", q.split(".")[0]))
    held = {p.messages[0]["content"] for p in arithmetic_problems(50, split=HELD_OUT, digits=4, terms=3)}
    assert not held & {p.messages[0]["content"] for p in train}
    with pytest.raises(ValueError):
        arithmetic_problem(0, split="test")


def test_stream_resumes_from_its_position():
    cfg = DataConfig()
    a = PromptStream(cfg)
    first, second = a.take(5), a.take(3)
    assert a.position == 8
    b = PromptStream(cfg, position=5)
    assert b.take(3) == second and first[0].index == 0
    assert len(held_out_problems(DataConfig(eval_size=4))) == 4 and held_out_problems(DataConfig(eval_size=0)) == []


def test_dataset_stream_permutes_each_epoch(tmp_path):
    path = tmp_path / "d.parquet"
    n = 5
    pq.write_table(pa.table({"prompt": [[{"role": "user", "content": f"q{i}"}] for i in range(n)],
                             "reward_model": [{"ground_truth": str(i)} for i in range(n)]}), path)
    s = PromptStream(DataConfig(train=str(path)))
    epoch0, epoch1 = s.take(n), s.take(n)
    assert sorted(p.index for p in epoch0) == sorted(p.index for p in epoch1) == list(range(n))
    assert PromptStream(DataConfig(train=str(path)), position=n).take(n) == epoch1

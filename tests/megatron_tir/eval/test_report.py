"""The evaluation report: pass@k against the closed form, maj@k on crafted answers, rows per
dataset and data source, and two datasets in one command giving two rows (a real run with a
scripted engine, a real sandbox and math-verify)."""

import json
import math
from itertools import combinations

import pandas as pd
import pytest

from megatron_tir.data.problems import Problem
from megatron_tir.eval.report import format_table, majority_correct, report_ks, report_rows
from megatron_tir.rollout import FinishStatus, Group, Trajectory, Turn
from megatron_tir.rollout.engines.base import FinishReason
from megatron_tir.tir import TurnKind

from test_eval_cli import run_cli, scripted, solve


def group(gid, rewards, answers, source="s"):
    trajs = []
    for s, (r, a) in enumerate(zip(rewards, answers)):
        t = Trajectory(group_id=gid, sample_index=s, prompt_ids=[1], status=FinishStatus.COMPLETED, reward=r,
                       turns=[Turn(index=0, kind=TurnKind.ANSWER, reason="", finish_reason=FinishReason.STOP,
                                   start=0, model_tokens=1)])
        t.append_model_tokens([5], [-0.1], [0])
        t.final_answer = a
        trajs.append(t)
    problem = Problem(index=gid, messages=({"role": "user", "content": "q"},), ground_truth="1", data_source=source)
    return Group(group_id=gid, problem=problem, trajectories=trajs)


def brute_pass_at_k(rewards, k):
    """The share of all k-subsets of the samples that hold a correct one (what pass@k estimates)."""
    subsets = list(combinations(range(len(rewards)), k))
    return sum(any(rewards[i] > 0 for i in s) for s in subsets) / len(subsets)


def test_report_ks():
    assert report_ks(1) == [1] and report_ks(4) == [1, 2, 4] and report_ks(6) == [1, 2, 4, 6]
    assert report_ks(32) == [1, 2, 4, 8, 16, 32]


@pytest.mark.parametrize("counts", [(0, 1, 3, 8), (2, 2, 5, 7)])
def test_pass_at_k_rows_equal_the_closed_form_and_the_subset_count(counts):
    n = 8
    groups = [group(i, [1.0] * c + [0.0] * (n - c), ["1"] * n) for i, c in enumerate(counts)]
    (row,) = report_rows([("d", groups)])
    for k in report_ks(n):
        closed = sum(1 - math.comb(n - c, k) / math.comb(n, k) for c in counts) / len(counts)
        brute = sum(brute_pass_at_k(g.rewards, k) for g in groups) / len(groups)
        assert row["pass_at"][str(k)] == pytest.approx(closed) == pytest.approx(brute)
    assert row["pass_at"]["1"] == pytest.approx(row["avg_at_n"]) == pytest.approx(sum(counts) / (n * len(counts)))


def test_majority_vote_on_crafted_answers():
    # "7" twice (wrong) beats "5" once (right)
    assert majority_correct(["7", "5", "7"], [0, 1, 0], 3) == 0.0
    # the first k only: among the first two, "7" and "5" tie; the tie goes to the first seen ("7")
    assert majority_correct(["7", "5", "5"], [0, 1, 1], 2) == 0.0
    assert majority_correct(["5", "7", "7"], [1, 0, 0], 2) == 1.0
    # samples without an answer do not vote; whitespace does not split a vote
    assert majority_correct([None, " 5", "5 ", "7"], [0, 1, 1, 0], 4) == 1.0
    assert majority_correct([None, ""], [0, 0], 2) == 0.0
    with pytest.raises(ValueError):
        majority_correct(["1"], [1], 2)


def test_rows_per_dataset_and_per_data_source():
    a = [group(0, [1, 0], ["1", "2"], "x"), group(1, [0, 0], ["3", "3"], "y")]
    b = [group(2, [1, 1], ["1", "1"], "z")]
    rows = report_rows([("a", a), ("b", b)])
    assert [(r["dataset"], r["data_source"], r["problems"]) for r in rows] == [
        ("a", "*", 2), ("a", "x", 1), ("a", "y", 1), ("b", "*", 1)]
    assert rows[0]["avg_at_n"] == 0.25 and rows[1]["avg_at_n"] == 0.5 and rows[3]["maj_at"]["2"] == 1.0
    table = format_table(rows).splitlines()
    assert len(table) == 2 + 4 and table[0].split()[:7] == ["dataset", "source", "problems", "n", "avg@n",
                                                             "pass@1", "pass@2"]


def test_two_datasets_in_one_command_give_two_rows(capsys, monkeypatch, tmp_path):
    paths = []
    for name, (question, truth) in {"first": ("What is 1+1?", "2"), "second": ("What is 2+3?", "5")}.items():
        path = tmp_path / f"{name}.parquet"
        pd.DataFrame({"prompt": [[{"role": "user", "content": question}]], "reward_model": [{"ground_truth": truth}],
                      "data_source": [name]}).to_parquet(path)
        paths.append(str(path))
    scripted(monkeypatch, solve)  # solves 1+1 with code, answers 2+3 wrongly
    out = tmp_path / "samples.jsonl"
    code, stdout, err = run_cli(capsys, "eval", "--model", "smollm2", "--data", paths[0], "--data", paths[1],
                                "--k", "2", "--set", "rollout.top_p=0.9", "--out", str(out), "--no-progress")
    assert code == 0, err
    assert "avg@2: 50.0%" in stdout and "top-p 0.9" in stdout
    report = json.loads((tmp_path / "samples.metrics.json").read_text())
    rows = report["rows"]
    assert [(r["dataset"], r["problems"], r["avg_at_n"]) for r in rows] == [(paths[0], 1, 1.0), (paths[1], 1, 0.0)]
    assert rows[0]["code_use_ratio"] == 0.5 and rows[1]["code_use_ratio"] == 0.0
    assert report["config"]["rollout"]["top_p"] == 0.9 and report["config"]["data"] == paths
    table = stdout[stdout.index("\ndataset ") + 1:].splitlines()
    assert table[2].startswith(paths[0]) and table[3].startswith(paths[1])


def test_recipe_and_set_overrides(capsys):
    from megatron_tir.cli import build_parser
    from megatron_tir.eval import cli as eval_cli

    args = build_parser().parse_args(["eval", "--recipe", "qwen2.5-7b-simpletir-eval", "--sglang-url", "http://h:1",
                                      "--set", "rollout.max_turns=5", "--k", "16"])
    cfg = eval_cli.config_from_args(args)
    assert cfg.data == ("aime24", "aime25", "math500") and cfg.rollout.top_p == 0.7 and cfg.rollout.max_turns == 5
    assert cfg.k == 16 and cfg.engine.urls == ("http://h:1",) and cfg.rollout.protocol == "simpletir"
    cfg = eval_cli.config_from_args(build_parser().parse_args(["eval", "--recipe", "qwen2.5-7b-simpletir-eval"]))
    assert cfg.k == 32 and cfg.rollout.max_turns == 10 and cfg.rollout.temperature == 1.0
    code, _, err = run_cli(capsys, "eval", "--model", "smollm2", "--data", "aime24", "--set", "rollout.nope=1")
    assert code == 2 and "unknown key 'rollout.nope'" in err
    code, _, err = run_cli(capsys, "eval", "--model", "smollm2")
    assert code == 2 and "--data" in err

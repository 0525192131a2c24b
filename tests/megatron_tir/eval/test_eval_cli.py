"""``megatron-tir eval``: errors at the edge, and a real run (tiny model, real cluster) end to end."""

import json

import pandas as pd
import pytest

from megatron_tir.cli import main


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_unknown_dataset_is_a_one_line_error(capsys):
    code, out, err = run_cli(capsys, "eval", "--model", "smollm2", "--data", "aime2030", "--k", "1")
    assert code == 2
    assert err.strip().count("\n") == 0
    assert "megatron-tir eval: error: dataset 'aime2030' is neither a known name" in err


def test_bad_model_is_a_one_line_error(capsys, tmp_path):
    code, _, err = run_cli(capsys, "eval", "--model", str(tmp_path / "nope"), "--data", "aime24", "--limit", "1")
    assert code == 2 and "is neither 'smollm2' nor an existing directory" in err


def test_bad_parquet_column_is_named(capsys, tmp_path):
    path = tmp_path / "q.parquet"
    pd.DataFrame({"question": ["1+1"], "reward_model": [{"ground_truth": "2"}]}).to_parquet(path)
    code, _, err = run_cli(capsys, "eval", "--model", "smollm2", "--data", str(path))
    assert code == 2 and "missing column(s) prompt" in err


def test_sglang_needs_url(capsys):
    code, _, err = run_cli(capsys, "eval", "--model", "smollm2", "--data", "aime24", "--engine", "sglang")
    assert code == 2 and "--engine sglang needs --sglang-url" in err


@pytest.mark.parametrize("flag", [["--k", "0"], ["--max-turns", "-1"], ["--temperature", "x"]])
def test_argparse_rejects_bad_numbers(capsys, flag):
    with pytest.raises(SystemExit) as exc:
        main(["eval", "--model", "smollm2", "--data", "aime24", *flag])
    assert exc.value.code == 2


def test_eval_end_to_end_tiny_model(capsys, tmp_path, make_tiny_hf):
    data = tmp_path / "two.parquet"
    pd.DataFrame({
        "prompt": [[{"role": "user", "content": "What is 1+1?"}], [{"role": "user", "content": "What is 2+3?"}]],
        "reward_model": [{"ground_truth": "2"}, {"ground_truth": "5"}],
        "data_source": ["unit", "unit"],
    }).to_parquet(data)
    out = tmp_path / "res" / "samples.jsonl"
    code, stdout, _ = run_cli(capsys, "eval", "--model", str(make_tiny_hf("llama")), "--data", str(data), "--k", "2",
                              "--max-turns", "2", "--max-response-tokens", "12", "--out", str(out), "--no-progress")
    assert code == 0, stdout
    assert "avg@2: 0.0%" in stdout and "pass@2: 0.0%" in stdout
    assert "void-trajectory ratio: 100.0%" in stdout and "finish ratio: 0.0%" in stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4
    assert sorted((r["group_id"], r["sample_index"]) for r in rows) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in rows:
        assert r["reward"] == 0.0 and r["status"] == "void" and r["model_tokens"] <= 12
        assert r["prompt"].rstrip().endswith("Solution:") and isinstance(r["response"], str)
        assert r["turns"][0]["kind"] == "void" and r["turns"][0]["text"]
        assert r["ground_truth"] in ("2", "5")

"""``megatron-tir data``: GSM8K / MATH / DeepScaleR-style local files into the verl schema the trainer reads;
rows that do not fit are named by row."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_tir.cli import main
from megatron_tir.data.prepare import convert, detect_format, prepare
from megatron_tir.data.problems import load_problems

# rows shaped as the public sets ship them (GSM8K's answer ends "#### N"; MATH keeps it in \boxed{})
GSM8K = [{"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
                      "in May. How many clips did Natalia sell altogether in April and May?",
          "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
                    "altogether in April and May.\n#### 72"},
         {"question": "What is 1000 + 234?", "answer": "1000 + 234 = 1234\n#### 1,234"}]
MATH = [{"problem": "What is $\\frac{1}{2}+\\frac{1}{3}$?", "level": "Level 1", "type": "Prealgebra",
         "solution": "The sum is $\\frac{3}{6}+\\frac{2}{6}=\\boxed{\\frac{5}{6}}$."}]
DEEPSCALER = [{"problem": "Find $x$ if $2x = 10$.", "answer": "5", "solution": "x = 5"}]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_gsm8k_jsonl_to_verl_parquet_read_by_the_trainer(tmp_path, capsys):
    src, out = _jsonl(tmp_path / "gsm8k.jsonl", GSM8K), tmp_path / "out" / "gsm8k.parquet"
    assert main(["data", str(src), "--out", str(out), "--split", "test"]) == 0
    assert "2 problems (verl schema)" in capsys.readouterr().out
    problems = load_problems(out)
    assert [p.ground_truth for p in problems] == ["72", "1234"]  # after ####, the thousands separator removed
    assert problems[0].messages == ({"role": "user", "content": GSM8K[0]["question"]},)
    row = pq.read_table(out).to_pylist()[1]
    assert row["data_source"] == "gsm8k" and row["reward_model"] == {"ground_truth": "1234", "style": "rule"}
    assert row["extra_info"] == {"index": 1, "split": "test"} and row["ability"] == "math"


def test_math_parquet_and_deepscaler_json(tmp_path):
    src = tmp_path / "math.parquet"
    pq.write_table(pa.Table.from_pylist(MATH), src)
    assert prepare(src, tmp_path / "m.parquet", source="math") == (1, [])
    assert load_problems(tmp_path / "m.parquet")[0].ground_truth == "\\frac{5}{6}"  # the last \boxed{}, nested braces
    src = tmp_path / "ds.json"
    src.write_text(json.dumps(DEEPSCALER))
    assert prepare(src, tmp_path / "d.parquet") == (1, [])
    assert load_problems(tmp_path / "d.parquet")[0].ground_truth == "5"
    assert prepare(tmp_path / "m.parquet", tmp_path / "again.parquet")[0] == 1  # verl in: checked and copied
    assert pq.read_table(tmp_path / "again.parquet").to_pylist()[0]["data_source"] == "math"  # its own source
    assert [detect_format(r) for r in (GSM8K[0], MATH[0], DEEPSCALER[0])] == ["gsm8k", "math", "deepscaler"]


def test_bad_rows_are_named_by_row(tmp_path, capsys):
    rows = GSM8K + [{"question": "No marker", "answer": "the answer is 3"}, {"question": "", "answer": "#### 1"}]
    src = _jsonl(tmp_path / "bad.jsonl", rows)
    assert main(["data", str(src), "--out", str(tmp_path / "x.parquet")]) == 2
    # one line of its own (in the full suite a log handler an earlier test left on a closed stream may add
    # a "--- Logging error ---" report around it)
    err = capsys.readouterr().err.splitlines()
    assert (f"megatron-tir: error: {src}: row 2: 'answer' has no '#### <number>' line (format gsm8k; "
            f"--skip-bad leaves such rows out)") in err
    written, bad = prepare(src, tmp_path / "x.parquet", skip_bad=True)
    assert written == 2 and bad == ["row 2: 'answer' has no '#### <number>' line", "row 3: 'question' is empty"]
    with pytest.raises(ValueError, match=r"row 0: 'solution' has no \\boxed\{\.\.\.\} answer"):
        convert([{"problem": "p", "solution": "no box"}], "math")
    (tmp_path / "broken.jsonl").write_text('{"question": "a", "answer": "#### 1"}\n{oops\n')
    with pytest.raises(ValueError, match=r"broken.jsonl: line 2: not valid JSON"):
        prepare(tmp_path / "broken.jsonl", tmp_path / "y.parquet")
    with pytest.raises(ValueError, match=r"no known format has the keys \['text'\]"):
        prepare(_jsonl(tmp_path / "t.jsonl", [{"text": "hi"}]), tmp_path / "z.parquet")

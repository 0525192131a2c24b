"""Local math sets into the verl parquet schema the trainer reads (``megatron-tir data``).

    megatron-tir data gsm8k_train.jsonl --out data/gsm8k_train.parquet
    megatron-tir data MATH_test.parquet --out data/math_test.parquet --format math --source math
    megatron-tir train --recipe qwen2.5-7b-simpletir --set data.train=data/gsm8k_train.parquet ...

Input: JSON Lines, a JSON list of objects, or parquet, with one problem per row. Formats (``auto``
picks by the columns of the first row):

* ``gsm8k`` -- ``question``; ``answer`` ends with ``#### 72`` (the number after ``####``, thousands
  separators removed, is the ground truth);
* ``math`` -- ``problem``; ``solution`` holds the answer in its last ``\\boxed{}`` (Hendrycks MATH);
* ``deepscaler`` -- ``problem`` and ``answer`` (DeepScaleR, most "problem/answer" sets);
* ``verl`` -- already ``prompt`` (a list of role/content messages) and ``reward_model.ground_truth``:
  checked and copied.

Output rows: ``data_source``, ``prompt`` (one user message: the bare question -- the rollout's
prompt adds the tool instruction), ``ability`` ("math"), ``reward_model`` (``ground_truth``,
``style`` "rule") and ``extra_info`` (``index``: the input row, ``split``). A row that does not fit
its format is an error naming the file and the row (``train.jsonl: row 17: 'answer' has no
'#### <number>'``); with ``skip_bad`` such rows are left out and counted instead. The written file
is read back with the trainer's own loader before the command reports success.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

FORMATS = ("auto", "gsm8k", "math", "deepscaler", "verl")
GSM8K_ANSWER = re.compile(r"####\s*(.+?)\s*$", re.DOTALL)


@dataclass(frozen=True, slots=True)
class Row:
    """One converted problem."""
    index: int
    question: str
    ground_truth: str
    source: str | None = None  # the row's own data_source (verl input), kept unless --source is given


def read_rows(path: Path) -> list[dict]:
    """The input file's rows as dicts (JSON Lines, a JSON list, or parquet); ValueError naming the line."""
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except (pa.ArrowInvalid, OSError) as exc:
            raise ValueError(f"{path}: not a readable parquet file ({exc})") from None
    text = path.read_text()
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: line {exc.lineno}: not valid JSON ({exc.msg})") from None
    else:
        rows = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: line {number}: not valid JSON ({exc.msg})") from None
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"{path}: row {i}: expected an object, got {type(row).__name__}")
    return rows


def detect_format(row: dict) -> str:
    """The format of a row from its keys; ValueError listing the keys when none fits."""
    keys = set(row)
    if {"prompt", "reward_model"} <= keys:
        return "verl"
    if {"question", "answer"} <= keys:
        return "gsm8k"
    if {"problem", "answer"} <= keys:
        return "deepscaler"
    if {"problem", "solution"} <= keys:
        return "math"
    raise ValueError(f"no known format has the keys {sorted(keys)} (gsm8k: question, answer; math: problem, "
                     f"solution; deepscaler: problem, answer; verl: prompt, reward_model); pass --format")


def _text(row: dict, key: str) -> str:
    value = row.get(key)
    if value is None:
        raise ValueError(f"no '{key}'")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise ValueError(f"'{key}' is a {type(value).__name__}, not text")
    if not value.strip():
        raise ValueError(f"'{key}' is empty")
    return value.strip()


def convert_row(row: dict, fmt: str, index: int) -> Row:
    """One input row as a :class:`Row`; ValueError saying what is wrong with it (without the row number)."""
    if fmt == "gsm8k":
        m = GSM8K_ANSWER.search(_text(row, "answer"))
        if m is None:
            raise ValueError("'answer' has no '#### <number>' line")
        truth = m.group(1).replace(",", "").strip()
        return Row(index, _text(row, "question"), truth)
    if fmt == "math":
        from megatron_tir.tir.markup import last_boxed

        truth = last_boxed(_text(row, "solution"))
        if truth is None or not truth.strip():
            raise ValueError("'solution' has no \\boxed{...} answer")
        return Row(index, _text(row, "problem"), truth.strip())
    if fmt == "deepscaler":
        return Row(index, _text(row, "problem"), _text(row, "answer"))
    if fmt == "verl":
        prompt, reward = row.get("prompt"), row.get("reward_model")
        if not isinstance(prompt, list) or not prompt or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in prompt):
            raise ValueError("'prompt' must be a non-empty list of {role, content} messages")
        users = [m["content"] for m in prompt if m["role"] == "user"]
        if not users:
            raise ValueError("'prompt' has no user message")
        if not isinstance(reward, dict):
            raise ValueError("'reward_model' must be a mapping with 'ground_truth'")
        source = row.get("data_source")
        return Row(index, users[-1].strip(), _text(reward, "ground_truth"),
                   source if isinstance(source, str) and source else None)
    raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")


def convert(rows: list[dict], fmt: str, *, skip_bad: bool = False) -> tuple[list[Row], list[str]]:
    """The converted rows and the problems of the rows left out (``skip_bad``); ValueError ``row N: ...``
    for the first bad row otherwise."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if not rows:
        raise ValueError("no rows")
    if fmt == "auto":
        fmt = detect_format(rows[0])
        log.info("format %s (from the keys of row 0)", fmt)
    out, bad = [], []
    for i, row in enumerate(rows):
        try:
            out.append(convert_row(row, fmt, i))
        except ValueError as exc:
            if not skip_bad:
                raise ValueError(f"row {i}: {exc} (format {fmt}; --skip-bad leaves such rows out)") from None
            bad.append(f"row {i}: {exc}")
    if not out:
        raise ValueError(f"no row fits the {fmt} format ({bad[0] if bad else ''})")
    return out, bad


def verl_records(rows: list[Row], *, source: str | None, default_source: str, split: str) -> Iterator[dict]:
    for row in rows:
        yield {"data_source": source or row.source or default_source, "prompt": [{"role": "user", "content": row.question}], "ability": "math",
               "reward_model": {"ground_truth": row.ground_truth, "style": "rule"},
               "extra_info": {"index": row.index, "split": split}}


def prepare(src: Path, out: Path, *, fmt: str = "auto", source: str | None = None, split: str = "train",
            limit: int | None = None, skip_bad: bool = False) -> tuple[int, list[str]]:
    """Convert ``src`` into the verl parquet ``out``; (rows written, problems of the rows left out)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from megatron_tir.data.problems import load_problems

    if out.suffix != ".parquet":
        raise ValueError(f"--out {out}: the output is a parquet file (name it *.parquet)")
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    rows = read_rows(src)[:limit]
    try:
        converted, bad = convert(rows, fmt, skip_bad=skip_bad)
    except ValueError as exc:
        raise ValueError(f"{src}: {exc}") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    records = verl_records(converted, source=source, default_source=src.stem, split=split)
    pq.write_table(pa.Table.from_pylist(list(records)), out)
    load_problems(out)  # the trainer's own reader accepts it
    return len(converted), bad

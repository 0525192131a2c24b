"""Math problems from verl-schema parquet files.

Schema: ``prompt`` is a list of ``{role, content}`` messages, ``reward_model`` a struct
with ``ground_truth``; ``data_source`` is optional. Datasets are named (``aime24``,
``aime25``, ``math500``, ``math_train``) or given as a file path. The named ones ship with
the package (the parquet files beside this module, ~4 MB); ``$MEGATRON_TIR_DATA`` names
another folder holding files of the same names.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

NAMED_DATASETS = {
    "aime24": "aime24.parquet",
    "aime25": "aime25.parquet",
    "math500": "math500.parquet",
    "math_train": "math_level3to5_train.parquet",
}
REQUIRED_COLUMNS = ("prompt", "reward_model")

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True, frozen=True)
class Problem:
    index: int  # row in the file
    messages: tuple[dict, ...]  # {"role": ..., "content": ...}
    ground_truth: str
    data_source: str = ""

    def __post_init__(self) -> None:
        if not self.messages:
            raise ValueError(f"problem {self.index}: empty prompt")
        for m in self.messages:
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"problem {self.index}: prompt messages need string 'role' and 'content'")
        if not any(m["role"] == "user" for m in self.messages):
            raise ValueError(f"problem {self.index}: prompt has no user message")
        if not self.ground_truth.strip():
            raise ValueError(f"problem {self.index}: empty reward_model.ground_truth")


def data_dir() -> Path:
    env = os.environ.get("MEGATRON_TIR_DATA")
    if env:
        return Path(env)
    return Path(__file__).resolve().parent


def resolve_dataset(name_or_path: str | os.PathLike) -> Path:
    """A dataset name or a parquet path -> an existing file; ValueError naming the problem."""
    key = str(name_or_path)
    if key in NAMED_DATASETS:
        path = data_dir() / NAMED_DATASETS[key]
        if not path.is_file():
            raise ValueError(f"dataset {key!r}: {path} not found (set MEGATRON_TIR_DATA to the data folder)")
        return path
    path = Path(name_or_path)
    if not path.is_file():
        names = ", ".join(NAMED_DATASETS)
        raise ValueError(f"dataset {key!r} is neither a known name ({names}) nor an existing file")
    return path


def _messages(value, row: int) -> tuple[dict, ...]:
    if value is None or isinstance(value, (str, bytes)):
        raise ValueError(f"row {row}: 'prompt' must be a list of {{role, content}} messages, got {type(value).__name__}")
    try:
        items = list(value)
    except TypeError:
        raise ValueError(f"row {row}: 'prompt' must be a list of {{role, content}} messages") from None
    out = []
    for m in items:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"row {row}: each 'prompt' message needs 'role' and 'content'")
        out.append({"role": m["role"], "content": m["content"]})
    return tuple(out)


def load_problems(name_or_path: str | os.PathLike, *, limit: int | None = None) -> list[Problem]:
    """Read problems from a verl-schema parquet file (all rows, or the first ``limit``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    path = resolve_dataset(name_or_path)
    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise ValueError(f"{path}: not a readable parquet file ({exc})") from None
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise ValueError(f"{path}: missing column(s) {', '.join(missing)} (verl schema needs prompt, reward_model)")
    if limit is not None:
        table = table.slice(0, limit)
    if table.num_rows == 0:
        raise ValueError(f"{path}: no rows")
    prompts = table.column("prompt").to_pylist()
    rewards = table.column("reward_model").to_pylist()
    sources = table.column("data_source").to_pylist() if "data_source" in table.column_names else [""] * len(prompts)
    problems = []
    unscorable = []
    for i, (p, rm, src) in enumerate(zip(prompts, rewards, sources)):
        if not isinstance(rm, dict) or rm.get("ground_truth") is None:
            raise ValueError(f"{path}: row {i}: reward_model has no ground_truth")
        gt = rm["ground_truth"]
        if isinstance(gt, (list, tuple)):  # some verl files store several accepted answers
            if not gt:
                raise ValueError(f"{path}: row {i}: empty reward_model.ground_truth list")
            gt = gt[0]
        if not str(gt).strip():  # nothing to check an answer against (2 rows of math_train)
            unscorable.append(i)
            continue
        try:
            problems.append(Problem(index=i, messages=_messages(p, i), ground_truth=str(gt),
                                    data_source=str(src or "")))
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
    if unscorable:
        log.warning("%s: skipped %d row(s) with an empty ground truth (rows %s)", path, len(unscorable),
                    ", ".join(map(str, unscorable[:10])))
    if not problems:
        raise ValueError(f"{path}: no row has a ground truth")
    return problems

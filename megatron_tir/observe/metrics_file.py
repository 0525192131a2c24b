"""``RUN_DIR/metrics.jsonl``: one JSON object per step (``{"step": N, "<metric>": value, ...}``), non-finite
values written as null. The trainer's sink (:class:`megatron_tir.train.metrics.MetricsSink`) appends it;
plots, the run summary and the benchmarks read it here."""

from __future__ import annotations

import json
import os
from pathlib import Path

METRICS_FILE = "metrics.jsonl"


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """The rows of ``RUN_DIR/metrics.jsonl`` in order; ValueError when the file is missing."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise ValueError(f"{run_dir}: no {METRICS_FILE} (not a run directory?)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

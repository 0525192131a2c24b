"""Benchmark: the latency of TIR code cells typical of the training data, on the real sandbox cluster.

    python bench/bench_cells.py [--repeats 3] [--workers 2] [--timeout 10] [--out FILE]

The cells (``bench/data/tir_cells.jsonl``: sympy solves, simplifications and series, numpy
loops and Monte Carlo, brute-force enumerations, prime sieves, dynamic programmes, exact
fractions, a runtime error and a loop that runs into the time limit) run as the rollout runs
a model's code block: ``FINAL_ANSWER_PRELUDE`` + the cell, through a ``LocalCluster`` (broker,
workers, warm zygotes, full isolation where the host allows it) and a ``SandboxClient``, one
call at a time, with the rollout's default limits (``rollout.tool_timeout_s`` 10 s,
``tool_memory_mb`` 1024). Each cell runs ``--repeats`` times; the latency is the client's wall
time per call.

It prints a table per cell and writes ``--out`` (JSON: the command, the host's cores, per cell
its status and latencies, and over all calls mean / p50 / p90 / p99 / max). The capacity planner
sizes sandbox slots from these figures (``megatron_tir.launch.plan.Assumptions``, which names the
file and the command that produced its numbers).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(_REPO))

log = logging.getLogger(__name__)

CELLS = _REPO / "bench" / "data" / "tir_cells.jsonl"


def load_cells(path: Path = CELLS) -> list[dict]:
    """The cells: one JSON object a line with ``name``, ``kind`` and ``code``."""
    cells = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        cell = json.loads(line)
        if not {"name", "kind", "code"} <= cell.keys():
            raise ValueError(f"{path}:{n}: a cell needs name, kind and code")
        cells.append(cell)
    return cells


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by linear interpolation between order statistics."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summary(latencies: list[float]) -> dict[str, float]:
    return {"calls": len(latencies), "mean_s": statistics.fmean(latencies), "p50_s": percentile(latencies, 0.5),
            "p90_s": percentile(latencies, 0.9), "p99_s": percentile(latencies, 0.99), "max_s": max(latencies)}


def run_cells(cells: list[dict], *, repeats: int, workers: int, timeout: float, memory_mb: int) -> dict[str, dict]:
    """Per cell: its statuses and latencies over ``repeats`` calls (one at a time)."""
    from megatron_tir.tir import FINAL_ANSWER_PRELUDE
    from sandbox_cluster import LocalCluster, SandboxClient

    out: dict[str, dict] = {}
    with LocalCluster(workers=workers) as cluster, SandboxClient(cluster.address) as client:
        client.run("print(1)", timeout=timeout)  # a first call through every layer before timing
        for r in range(repeats):  # rounds over all cells: a slow stretch of the host spreads over every cell
            for cell in cells:
                start = time.monotonic()
                result = client.run(FINAL_ANSWER_PRELUDE + cell["code"], timeout=timeout, memory_mb=memory_mb)
                took = time.monotonic() - start
                row = out.setdefault(cell["name"], {"kind": cell["kind"], "statuses": [], "latencies_s": []})
                row["statuses"].append(result.status.name)
                row["latencies_s"].append(round(took, 4))
                log.info("round %d %-28s %-10s %.3f s", r + 1, cell["name"], result.status.name, took)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cells", type=Path, default=CELLS)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, default=2, help="sandbox workers (one call runs at a time)")
    p.add_argument("--timeout", type=float, default=10.0, help="per call, s (rollout.tool_timeout_s)")
    p.add_argument("--memory-mb", type=int, default=1024, help="per call (rollout.tool_memory_mb)")
    p.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.repeats < 1 or args.workers < 1 or not args.timeout > 0:
        p.error("--repeats and --workers must be >= 1 and --timeout > 0")
    try:
        cells = load_cells(args.cells)
    except (OSError, ValueError) as exc:
        p.error(str(exc))
    per_cell = run_cells(cells, repeats=args.repeats, workers=args.workers, timeout=args.timeout,
                         memory_mb=args.memory_mb)
    every = [t for row in per_cell.values() for t in row["latencies_s"]]
    overall = summary(every)
    print(f"{'cell':30s} {'kind':14s} {'status':12s} {'p50 s':>8s} {'max s':>8s}")
    for name, row in per_cell.items():
        print(f"{name:30s} {row['kind']:14s} {'/'.join(sorted(set(row['statuses']))):12s} "
              f"{statistics.median(row['latencies_s']):8.3f} {max(row['latencies_s']):8.3f}")
    print(f"all {overall['calls']} calls: mean {overall['mean_s']:.3f} s, p50 {overall['p50_s']:.3f}, "
          f"p90 {overall['p90_s']:.3f}, p99 {overall['p99_s']:.3f}, max {overall['max_s']:.3f}")
    if args.out:
        command = "python bench/bench_cells.py " + " ".join(argv if argv is not None else sys.argv[1:])
        record = {"command": command.strip(), "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
                  "timeout_s": args.timeout, "overall": {k: round(v, 4) for k, v in overall.items()},
                  "cells": per_cell}
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

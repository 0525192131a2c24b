"""Reading a ``megatron-tir`` command that failed under ``torchrun`` (``train``, ``sft``: every rank runs it)."""

from __future__ import annotations

import re
import subprocess


def assert_one_line_from_rank_0(p: subprocess.CompletedProcess, line: str) -> None:
    """Bad input under torchrun: ``line`` is the only ``megatron-tir:`` line (rank 0's; the other ranks say
    nothing), and torchrun's report names rank 0, exit 2, the root cause (torchrun itself exits 1 whenever a
    rank fails, with its ChildFailedError report)."""
    errors = [x for x in p.stderr.splitlines() if "megatron-tir:" in x]
    assert errors == [line], p.stderr
    assert p.returncode == 1 and "ChildFailedError" in p.stderr, p.stderr[-3000:]
    root = p.stderr.split("Root Cause (first observed failure):")[1]
    assert re.search(r"rank\s*: 0 \(local_rank: 0\)", root) and re.search(r"exitcode\s*: 2 ", root), root

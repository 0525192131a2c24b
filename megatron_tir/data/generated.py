"""Datasets by name for evaluation: a parquet dataset, or the held-out split of a generated task.

``load_eval_problems("math500")`` reads the file (:func:`megatron_tir.data.load_problems`);
``load_eval_problems("arithmetic", limit=M)`` draws M held-out problems of the generated
arithmetic task (the split the trainer evaluates on with its defaults), never training ones;
``load_eval_problems("tir_mix", limit=M)`` the first M held-out problems of the task family
(:mod:`megatron_tir.data.tasks`: all seven families in turn, ``data_source`` = family).
"""

from __future__ import annotations

import os

from megatron_tir.data.arithmetic import HELD_OUT, arithmetic_problems
from megatron_tir.data.problems import Problem, load_problems
from megatron_tir.data.tasks import HELD_OUT as MIX_HELD_OUT
from megatron_tir.data.tasks import MIX, mix_problems

DEFAULT_GENERATED_SIZE = 64  # held-out problems of a generated task when no limit is given


def _arithmetic(n: int) -> list[Problem]:
    return arithmetic_problems(n, split=HELD_OUT)


def _mix(n: int) -> list[Problem]:
    return mix_problems(n, split=MIX_HELD_OUT)


GENERATED_TASKS = {"arithmetic": _arithmetic, MIX: _mix}


def load_eval_problems(name_or_path: str | os.PathLike, *, limit: int | None = None) -> list[Problem]:
    key = str(name_or_path)
    if key in GENERATED_TASKS:
        if limit is not None and limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        return GENERATED_TASKS[key](limit or DEFAULT_GENERATED_SIZE)
    return load_problems(name_or_path, limit=limit)

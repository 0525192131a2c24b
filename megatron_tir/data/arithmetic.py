"""A generated task a small model can learn to solve with code: multi-digit arithmetic.

Problem ``i`` of a split is a pure function of ``(seed, i)``: a product or sum of
``terms`` integers of ``digits`` digits ("Compute 4831 * 2967 + 512."), exact integer answer.
A 135M model cannot multiply four-digit numbers in its head, but one line of Python can, so
the reward measures whether the model computes with code and reports the result (as
``final_answer(x)`` in the code or ``\\boxed{x}``). Train and held-out splits use disjoint
seeds (``split_seed``).
"""

from __future__ import annotations

import random

from megatron_tir.data.problems import Problem

DATA_SOURCE = "arithmetic"
TRAIN, HELD_OUT = "train", "held_out"
_SPLIT_SALT = {TRAIN: 0, HELD_OUT: 1_000_003}
QUESTION = "Compute {expr}. Write Python code that calculates it and pass the result to final_answer()."


def split_seed(seed: int, split: str) -> int:
    if split not in _SPLIT_SALT:
        raise ValueError(f"split must be {TRAIN!r} or {HELD_OUT!r}, got {split!r}")
    return seed * 2_000_003 + _SPLIT_SALT[split]


def arithmetic_problem(index: int, *, seed: int = 0, split: str = TRAIN, digits: int = 4, terms: int = 2) -> Problem:
    """Problem ``index`` of ``split``: ``terms`` operands of ``digits`` digits joined by * and +."""
    if index < 0 or digits < 1 or terms < 2:
        raise ValueError("need index >= 0, digits >= 1, terms >= 2")
    rng = random.Random(f"{split_seed(seed, split)}/{index}")
    lo, hi = 10 ** (digits - 1), 10 ** digits - 1
    nums = [rng.randint(lo, hi) for _ in range(terms)]
    ops = [rng.choice("*+") if i else "*" for i in range(terms - 1)]  # at least one product
    expr = str(nums[0])
    for op, n in zip(ops, nums[1:]):
        expr += f" {op} {n}"
    answer = eval(expr, {"__builtins__": {}})
    return Problem(index=index, messages=({"role": "user", "content": QUESTION.format(expr=expr)},),
                   ground_truth=str(answer), data_source=DATA_SOURCE)


def arithmetic_problems(n: int, *, start: int = 0, seed: int = 0, split: str = TRAIN, digits: int = 4,
                        terms: int = 2) -> list[Problem]:
    return [arithmetic_problem(i, seed=seed, split=split, digits=digits, terms=terms) for i in range(start, start + n)]

"""A generated family of problems where running code is what gets the answer right (``tir_mix``).

Seven families, each at three difficulty levels, each answer an exact integer (or a digit
string) computed by the generator:

========================  ===============================================================
``arithmetic``            products and sums of 3-5 digit integers
``digit_sum``             the sum of the decimal digits of ``a ** b``
``count_primes``          how many primes lie in ``[lo, hi]`` (ranges up to 10^6)
``count_divisors``        how many positive divisors ``n`` has (``n`` up to ~10^13)
``recurrence``            ``a_N mod m`` for ``a_n = p a_(n-1) + q a_(n-2)`` (``N`` up to 5000)
``gcd_lcm``               the gcd or the lcm of 2-4 integers with shared factors
``base_conversion``       a decimal integer written in base 2-9 (the held-out family)
========================  ===============================================================

Level 1 of every family but ``arithmetic`` also names the code: the question ends "In
Python, `<one line>` computes it." (:func:`hint_code`; e.g. ``import math; math.gcd(295, 118)``);
levels 2 and 3 state the problem only, with larger numbers. The hint is the rung a small model
climbs first; the unhinted levels are where it has to carry a family's code over itself.

Problem ``i`` of a split is a pure function of ``(seed, split, i)``. The training split
cycles through the first six families with every other prompt arithmetic
(``TRAIN_FAMILY_CYCLE``), one cycle per level in the order ``TRAIN_LEVEL_CYCLE`` (1, 2, 1, 3:
half the prompts at level 1); the held-out split cycles through all seven at levels 1, 2, 3, so
``base_conversion`` is a family the policy never trains on (its level-1 problems carry a hint
too: whether reading and running a named one-liner carries over to an unseen family).
The two splits are disjoint by construction, not by chance: a problem belongs to the
held-out split exactly when a hash of its question falls in one bucket of ten, and each
split redraws until its problems land on its side. ``data_source`` is the family's name,
so ``megatron-tir eval --data tir_mix`` reports one row per family.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from megatron_tir.data.problems import Problem

MIX = "tir_mix"
TRAIN, HELD_OUT = "train", "held_out"
TRAIN_FAMILIES = ("arithmetic", "digit_sum", "count_primes", "count_divisors", "recurrence", "gcd_lcm")
HELD_OUT_FAMILY = "base_conversion"
FAMILIES = (*TRAIN_FAMILIES, HELD_OUT_FAMILY)
LEVELS = (1, 2, 3)
# Training order: every other prompt is arithmetic (the family where a first correct answer is
# likeliest, ~1 in 32 samples for the base model: it teaches calling final_answer), then blocks of
# one cycle per level, half of them at level 1 (the hinted rung). Held out: each family in turn,
# levels 1, 2, 3.
TRAIN_FAMILY_CYCLE = tuple(f for other in TRAIN_FAMILIES[1:] for f in ("arithmetic", other))
TRAIN_LEVEL_CYCLE = (1, 2, 1, 3)
INSTRUCTION = " Write Python code that calculates it and pass the result to final_answer()."
_SPLIT_SALT = {TRAIN: 0, HELD_OUT: 7_000_003}


@dataclass(frozen=True, slots=True)
class TaskSpec:
    family: str
    level: int
    params: dict  # what the question states (the test recomputes the answer from these)
    question: str
    answer: str


# ----------------------------------------------------------------------------- the families


def _arithmetic(rng: random.Random, level: int) -> tuple[dict, str, str]:
    digits, terms = {1: (3, 2), 2: (4, 3), 3: (5, 3)}[level]
    nums = [rng.randint(10 ** (digits - 1), 10 ** digits - 1) for _ in range(terms)]
    ops = ["*"] + [rng.choice("*+") for _ in range(terms - 2)]
    expr = str(nums[0]) + "".join(f" {op} {n}" for op, n in zip(ops, nums[1:]))
    value = nums[0]
    pending = []  # evaluate with * before +
    for op, n in zip(ops, nums[1:]):
        if op == "*":
            value *= n
        else:
            pending.append(value)
            value = n
    return {"expr": expr}, f"Compute {expr}.", str(sum(pending) + value)


def _digit_sum(rng: random.Random, level: int) -> tuple[dict, str, str]:
    a_range, b_range = {1: ((2, 9), (10, 30)), 2: ((11, 99), (20, 60)), 3: ((101, 999), (50, 150))}[level]
    a, b = rng.randint(*a_range), rng.randint(*b_range)
    return {"a": a, "b": b}, f"What is the sum of the decimal digits of {a}^{b}?", str(sum(map(int, str(a ** b))))


def _sieve_count(lo: int, hi: int) -> int:
    flags = bytearray([1]) * (hi + 1)
    flags[0:2] = b"\x00\x00"
    for p in range(2, math.isqrt(hi) + 1):
        if flags[p]:
            flags[p * p :: p] = bytearray(len(range(p * p, hi + 1, p)))
    return sum(flags[lo:])


def _count_primes(rng: random.Random, level: int) -> tuple[dict, str, str]:
    top, width = {1: (10_000, 200), 2: (100_000, 2_000), 3: (1_000_000, 20_000)}[level]
    lo = rng.randint(2, top)
    hi = lo + rng.randint(width // 2, width)
    return ({"lo": lo, "hi": hi}, f"How many prime numbers p satisfy {lo} <= p <= {hi}?", str(_sieve_count(lo, hi)))


def _count_divisors(rng: random.Random, level: int) -> tuple[dict, str, str]:
    primes, factors = {1: ((2, 3, 5, 7), 5), 2: ((2, 3, 5, 7, 11, 13), 8), 3: ((2, 3, 5, 7, 11, 13, 17, 19, 23), 10)}[level]
    exponents: dict[int, int] = {}
    for _ in range(factors):
        p = rng.choice(primes)
        exponents[p] = exponents.get(p, 0) + 1
    n = math.prod(p ** e for p, e in exponents.items())
    count = math.prod(e + 1 for e in exponents.values())  # from the factorization the generator chose
    return {"n": n}, f"How many positive divisors does {n} have?", str(count)


def _recurrence(rng: random.Random, level: int) -> tuple[dict, str, str]:
    n_range, m_range = {1: ((10, 30), (97, 997)), 2: ((100, 500), (1_000, 9_999)), 3: ((1_000, 5_000), (10_000, 99_999))}[level]
    a0, a1, p, q = rng.randint(0, 9), rng.randint(1, 9), rng.randint(1, 5), rng.randint(1, 5)
    n, m = rng.randint(*n_range), rng.randint(*m_range)
    prev, cur = a0 % m, a1 % m
    for _ in range(n - 1):
        prev, cur = cur, (p * cur + q * prev) % m
    question = (f"A sequence has a_0 = {a0}, a_1 = {a1} and a_k = {p}*a_(k-1) + {q}*a_(k-2) for k >= 2. "
                f"What is a_{n} mod {m}?")
    return {"a0": a0, "a1": a1, "p": p, "q": q, "n": n, "m": m}, question, str(cur)


def _gcd_lcm(rng: random.Random, level: int) -> tuple[dict, str, str]:
    count, top = {1: (2, 1_000), 2: (3, 100_000), 3: (4, 10_000_000)}[level]
    common = rng.randint(2, 60)
    nums = [common * rng.randint(2, top // common) for _ in range(count)]
    kind = rng.choice(("gcd", "lcm"))
    listed = ", ".join(map(str, nums))
    if kind == "gcd":
        return ({"kind": kind, "nums": nums}, f"What is the greatest common divisor of {listed}?",
                str(math.gcd(*nums)))
    return {"kind": kind, "nums": nums}, f"What is the least common multiple of {listed}?", str(math.lcm(*nums))


def _base_conversion(rng: random.Random, level: int) -> tuple[dict, str, str]:
    lo, hi = {1: (100, 1_000), 2: (1_000, 100_000), 3: (100_000, 10_000_000)}[level]
    n, base = rng.randint(lo, hi), rng.randint(2, 9)
    digits, m = [], n
    while m:
        m, r = divmod(m, base)
        digits.append(str(r))
    question = f"Write the decimal number {n} in base {base} (the digits only, most significant first)."
    return {"n": n, "base": base}, question, "".join(reversed(digits))


# Level 1 names the code in the question (one line: builtins, the standard library, numpy).
# Measured (docs/training.md): SmolLM2-135M trained to call final_answer() on arithmetic solved
# 0 of 16 samples of every other family at levels 1 and 2 without it.
def hint_code(family: str, params: dict) -> str | None:
    """The level-1 hint: Python whose last statement is an expression worth the answer (None: no hint)."""
    if family == "digit_sum":
        return f"sum(int(d) for d in str({params['a']}**{params['b']}))"
    if family == "count_primes":
        lo, hi = params["lo"], params["hi"]
        return f"sum(1 for p in range({lo}, {hi + 1}) if all(p % d for d in range(2, int(p**0.5) + 1)))"
    if family == "count_divisors":
        n = params["n"]
        return f"sum(1 for d in range(1, {n + 1}) if {n} % d == 0)"
    if family == "gcd_lcm":
        return f"import math; math.{params['kind']}({', '.join(map(str, params['nums']))})"
    if family == "base_conversion":
        return f"import numpy; numpy.base_repr({params['n']}, {params['base']})"
    if family == "recurrence":
        p, q = params["p"], params["q"]
        return (f"from functools import reduce; reduce(lambda s, _: (s[1], {p}*s[1] + {q}*s[0]), "
                f"range({params['n'] - 1}), ({params['a0']}, {params['a1']}))[1] % {params['m']}")
    return None  # arithmetic states its expression already


GENERATORS: dict[str, Callable[[random.Random, int], tuple[dict, str, str]]] = {
    "arithmetic": _arithmetic, "digit_sum": _digit_sum, "count_primes": _count_primes,
    "count_divisors": _count_divisors, "recurrence": _recurrence, "gcd_lcm": _gcd_lcm,
    "base_conversion": _base_conversion,
}


# ----------------------------------------------------------------------------- splits


def _held_out_bucket(question: str) -> bool:
    return hashlib.sha256(question.encode()).digest()[0] % 10 == 0


def task_spec(family: str, index: int, *, level: int, seed: int = 0, split: str = TRAIN) -> TaskSpec:
    """Problem ``index`` of ``family`` at ``level`` in ``split`` (deterministic)."""
    if family not in GENERATORS:
        raise ValueError(f"unknown task family {family!r} (families: {', '.join(FAMILIES)})")
    if split not in _SPLIT_SALT:
        raise ValueError(f"split must be {TRAIN!r} or {HELD_OUT!r}, got {split!r}")
    if level not in LEVELS or index < 0:
        raise ValueError(f"need level in {LEVELS} and index >= 0, got level {level}, index {index}")
    rng = random.Random(f"{seed * 10_000_019 + _SPLIT_SALT[split]}/{family}/{level}/{index}")
    while True:  # each split keeps only the problems on its side of the hash
        params, question, answer = GENERATORS[family](rng, level)
        hint = hint_code(family, params) if level == 1 else None
        if hint is not None:
            question += f" In Python, `{hint}` computes it."
        if _held_out_bucket(question) == (split == HELD_OUT):
            return TaskSpec(family=family, level=level, params=params, question=question, answer=answer)


def mix_problem(index: int, *, seed: int = 0, split: str = TRAIN) -> Problem:
    """Problem ``index`` of the ``tir_mix`` split (families in turn, levels graded; module docstring)."""
    if split == TRAIN:
        family = TRAIN_FAMILY_CYCLE[index % len(TRAIN_FAMILY_CYCLE)]
        level = TRAIN_LEVEL_CYCLE[(index // len(TRAIN_FAMILY_CYCLE)) % len(TRAIN_LEVEL_CYCLE)]
        spec = task_spec(family, index, level=level, seed=seed, split=split)
    else:
        family = FAMILIES[index % len(FAMILIES)]
        level = LEVELS[(index // len(FAMILIES)) % len(LEVELS)]
        spec = task_spec(family, index // len(FAMILIES), level=level, seed=seed, split=split)
    return Problem(index=index, messages=({"role": "user", "content": spec.question + INSTRUCTION},),
                   ground_truth=spec.answer, data_source=family)


def mix_problems(n: int, *, start: int = 0, seed: int = 0, split: str = TRAIN) -> list[Problem]:
    return [mix_problem(i, seed=seed, split=split) for i in range(start, start + n)]

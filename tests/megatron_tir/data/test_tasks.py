"""The generated task family: every answer recomputed independently (sympy or another
algorithm) for the first 200 problems of each family, the splits disjoint, the held-out
family absent from training."""

import pytest
import sympy
from sympy.ntheory.digits import digits as sympy_digits

from megatron_tir.data.generated import load_eval_problems
from megatron_tir.data.tasks import (
    FAMILIES,
    HELD_OUT,
    HELD_OUT_FAMILY,
    LEVELS,
    TRAIN,
    TRAIN_FAMILIES,
    TRAIN_LEVEL_CYCLE,
    hint_code,
    mix_problems,
    task_spec,
)


def _recurrence_by_matrix_power(a0, a1, p, q, n, m):
    """a_n mod m as [[p, q], [1, 0]]^(n-1) applied to (a_1, a_0), by repeated squaring."""
    def mul(x, y):
        return [[(x[i][0] * y[0][j] + x[i][1] * y[1][j]) % m for j in range(2)] for i in range(2)]
    result, base, e = [[1, 0], [0, 1]], [[p, q], [1, 0]], n - 1
    while e:
        if e & 1:
            result = mul(result, base)
        base = mul(base, base)
        e >>= 1
    return (result[0][0] * a1 + result[0][1] * a0) % m


def independent_answer(family, params):
    if family == "arithmetic":
        return str(sympy.sympify(params["expr"]))
    if family == "digit_sum":
        return str(sum(sympy_digits(sympy.Integer(params["a"]) ** params["b"])[1:]))
    if family == "count_primes":
        return str(sympy.primepi(params["hi"]) - sympy.primepi(params["lo"] - 1))
    if family == "count_divisors":
        return str(sympy.divisor_count(params["n"]))
    if family == "recurrence":
        return str(_recurrence_by_matrix_power(*(params[k] for k in ("a0", "a1", "p", "q", "n", "m"))))
    if family == "gcd_lcm":
        op = sympy.igcd if params["kind"] == "gcd" else sympy.ilcm
        return str(op(*params["nums"]))
    if family == "base_conversion":
        return None  # checked by reading the digits back below
    raise AssertionError(family)


@pytest.mark.parametrize("family", FAMILIES)
def test_first_200_answers_match_an_independent_computation(family):
    split = HELD_OUT if family == HELD_OUT_FAMILY else TRAIN
    for i in range(200):
        level = LEVELS[i % len(LEVELS)]
        spec = task_spec(family, i, level=level, split=split)
        for value in spec.params.values():  # the question states the numbers the answer is computed from
            for v in (value if isinstance(value, list) else [value]):
                assert isinstance(v, str) or str(v) in spec.question, (spec.question, spec.params)
        if family == "base_conversion":
            base = spec.params["base"]
            assert spec.answer[0] != "0" and all(int(d) < base for d in spec.answer)
            assert int(spec.answer, base) == spec.params["n"]
        else:
            assert spec.answer == independent_answer(family, spec.params), (spec.question, spec.answer)


def test_train_and_held_out_are_disjoint_and_the_held_out_family_is_unseen():
    train = mix_problems(3000, split=TRAIN)
    held = mix_problems(700, split=HELD_OUT)
    assert {p.data_source for p in train} == set(TRAIN_FAMILIES)
    assert {p.data_source for p in held} == set(FAMILIES)
    questions = {p.messages[0]["content"] for p in train}
    assert not questions & {p.messages[0]["content"] for p in held}
    # deterministic, and each family cycles through the three levels
    assert mix_problems(12, split=TRAIN) == train[:12]
    assert load_eval_problems("tir_mix", limit=7) == held[:7]


def test_a_different_seed_gives_different_problems():
    a = mix_problems(12, seed=0)
    b = mix_problems(12, seed=1)
    assert all(x.messages != y.messages for x, y in zip(a, b))


def _run_hint(code):
    """Run the hint as the sandbox would: every statement, the last one's value returned."""
    *setup, last = code.split("; ")
    scope = {}
    exec("\n".join(setup), scope)
    return eval(last, scope)


@pytest.mark.parametrize("family", FAMILIES)
def test_level_1_names_code_that_computes_the_answer_and_the_other_levels_do_not(family):
    split = HELD_OUT if family == HELD_OUT_FAMILY else TRAIN
    for i in range(40):
        spec = task_spec(family, i, level=1, split=split)
        code = hint_code(family, spec.params)
        if family == "arithmetic":
            assert code is None and "In Python" not in spec.question
            continue
        assert f"In Python, `{code}` computes it." in spec.question
        assert str(_run_hint(code)) == spec.answer, (spec.question, spec.answer)
    for level in (2, 3):
        assert "In Python" not in task_spec(family, 0, level=level, split=split).question


def test_training_levels_follow_the_cycle_and_held_out_levels_cycle_1_2_3():
    train = mix_problems(10 * len(TRAIN_LEVEL_CYCLE), split=TRAIN)
    sources = [p.data_source for p in train]
    assert sources[0::2] == ["arithmetic"] * 20  # every other training prompt
    assert sources[1:10:2] == list(TRAIN_FAMILIES[1:])
    hinted = ["In Python" in p.messages[0]["content"] for p in train if p.data_source != "arithmetic"]
    assert hinted == [True] * 5 + [False] * 5 + [True] * 5 + [False] * 5  # levels 1, 2, 1, 3
    held = mix_problems(7 * 3, split=HELD_OUT)
    assert [("In Python" in p.messages[0]["content"]) for p in held if p.data_source == "gcd_lcm"] == [True, False, False]

"""math-verify reward: equivalent forms, wrong answers, and a check that would hang."""

import asyncio
import time

import pytest

from megatron_tir.reward import MathVerifier, RewardConfig


@pytest.fixture(scope="module")
def verifier():
    with MathVerifier(RewardConfig(timeout_s=6.0, workers=2)) as v:
        yield v


@pytest.mark.parametrize(
    ("answer", "truth"),
    [
        ("204", "204"),
        ("0.5", r"\frac{1}{2}"),
        ("1/2", r"\frac{1}{2}"),
        (r"\frac{\sqrt{2}}{2}", r"\frac{1}{\sqrt{2}}"),
        ("sqrt(2)/2", r"\frac{\sqrt{2}}{2}"),  # what final_answer prints for non-SymPy strings
        (r"(3, \pi/2)", r"\left( 3, \frac{\pi}{2} \right)"),
        ("(x+1)^2", "x^2+2x+1"),
        (r"70 \text{ dollars}", "70"),
    ],
)
def test_equivalent_forms_score_1(verifier, answer, truth):
    assert verifier.score(answer, truth) == 1.0


@pytest.mark.parametrize(
    ("answer", "truth"),
    [("205", "204"), (r"\frac{1}{3}", "0.5"), (r"(3, \pi)", r"\left( 3, \frac{\pi}{2} \right)"), ("x+1", "x^2+1")],
)
def test_wrong_answers_score_0(verifier, answer, truth):
    assert verifier.score(answer, truth) == 0.0


def test_no_answer_scores_0_without_a_check(verifier):
    v = verifier.check(None, "1")
    assert v.reward == 0.0 and v.error == "no final answer" and not v.timed_out


@pytest.mark.slow
def test_pathological_expression_times_out_and_pool_recovers():
    with MathVerifier(RewardConfig(timeout_s=3.0, workers=1)) as v:
        assert v.score("1", "1") == 1.0  # warm the worker (imports)
        t0 = time.perf_counter()
        verdict = v.check("(10^{9})!", "3")  # SymPy would compute a factorial of 1e9
        elapsed = time.perf_counter() - t0
        assert verdict.timed_out and verdict.reward == 0.0
        assert 2.9 < elapsed < 6.0
        assert v.score("3", "3") == 1.0  # a fresh worker replaced the killed one


def test_async_checks_from_event_loop(verifier):
    async def main():
        return await asyncio.gather(*(verifier.ascore(a, "12") for a in ["12", "24/2", "13", "12.0"]))

    assert asyncio.run(main()) == [1.0, 1.0, 0.0, 1.0]


def test_config_validation():
    with pytest.raises(ValueError, match="timeout_s"):
        RewardConfig(timeout_s=0)
    with pytest.raises(ValueError, match="workers"):
        RewardConfig(workers=0)


def test_a_new_workers_imports_do_not_count_against_the_check_limit():
    # importing math-verify and SymPy takes longer than this limit on a loaded machine;
    # the worker reports ready after its imports and only then is the check timed
    with MathVerifier(RewardConfig(timeout_s=3.0, workers=1)) as v:
        verdict = v.check("204", "204")
        assert verdict.correct and not verdict.timed_out, verdict

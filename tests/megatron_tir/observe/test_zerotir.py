"""ZeroTIR's metrics under its own definitions (yyht/openrlhf_async_pipline), hand-computed."""

from __future__ import annotations

import random

import pytest
from observe_crafted import answer_turn, code_turn, make

from megatron_tir.observe.zerotir import code_count, has_code, repeat_score, response_text, zerotir_metrics


def _brute_repeatness(s: str) -> float:
    """The definition spelled out: sorted suffixes, LCP of neighbours, summed, times 2 / (n (n + 1))."""
    n = len(s)
    if n <= 1:
        return 0.0
    suffixes = sorted(range(n), key=lambda i: s[i:])
    total = 0
    for a, b in zip(suffixes, suffixes[1:]):
        h = 0
        while a + h < n and b + h < n and s[a + h] == s[b + h]:
            h += 1
        total += h
    return total * 2 / (n * (n + 1))


def test_repeat_score_by_hand_and_against_the_definition():
    # "abab": sorted suffixes ab, abab, b, bab; neighbour LCPs 2, 0, 1 -> 3 * 2 / (4 * 5)
    assert repeat_score("abab") == pytest.approx(0.3)
    assert repeat_score("aaaa") == pytest.approx(0.6)  # LCPs 1, 2, 3
    assert repeat_score("abcd") == 0.0 and repeat_score("a") == 0.0 and repeat_score("") == 0.0
    rng = random.Random(0)
    for _ in range(200):
        s = "".join(rng.choice("ab c\n") for _ in range(rng.randint(0, 60)))
        assert repeat_score(s) == pytest.approx(_brute_repeatness(s), abs=1e-12)
    repeated = "The answer is 42. " * 50
    assert repeat_score(repeated) > 0.9 > repeat_score("The answer is 42. ")


def test_code_count_and_has_code_follow_zerotir():
    text = "Let me compute.\n```python\nprint(1)\n```\n```output\n1\n```\n```python\nx = 2\n```"
    assert code_count(text) == 2
    assert has_code(text)
    assert not has_code("no code at all") and not has_code("```python\n   \n```")  # a blank block is no code
    assert code_count("```python\nprint(1)") == 0 and not has_code("```python\nprint(1)")  # never closed


def test_zerotir_metrics_of_crafted_trajectories():
    coded_right = make([code_turn(0, "print(6)", stdout="6\n"), answer_turn(1, "\\boxed{6}", "6")], reward=1.0)
    coded_wrong = make([code_turn(0, "print(5)", stdout="5\n"), answer_turn(1, "\\boxed{5}", "5")], reward=0.0)
    prose_right = make([answer_turn(0, "It is \\boxed{6}", "6")], reward=1.0)
    assert response_text(coded_right).startswith("```python\nprint(6)\n```Code Execution Result: 6\n")
    m = zerotir_metrics([coded_right, coded_wrong, prose_right])
    assert m["code_count"] == pytest.approx(2 / 3)
    assert m["code_proportion"] == pytest.approx(2 / 3)
    assert m["code_in_correct"] == pytest.approx(1 / 3)  # of all responses, not of the correct ones
    assert m["avg_repeat_score"] == pytest.approx(sum(repeat_score(response_text(t)) for t in
                                                      (coded_right, coded_wrong, prose_right)) / 3)

"""A reward given by import path: ``--set reward.function=examples.plugins.rewards:exact_or_partial``.

The signature is ``fn(answer, ground_truth) -> float``: ``answer`` is the final answer the protocol
extracted (None when the model gave none), ``ground_truth`` the data row's. It runs in the reward
workers with ``reward.timeout_s`` per call.
"""

from __future__ import annotations


def exact_or_partial(answer: str | None, ground_truth: str) -> float:
    """1 for the exact answer (spaces and a trailing ``.0`` ignored), 0.1 for any answer, 0 for none."""
    if answer is None:
        return 0.0
    norm = lambda s: "".join(s.split()).removesuffix(".0")  # noqa: E731
    return 1.0 if norm(answer) == norm(ground_truth) else 0.1

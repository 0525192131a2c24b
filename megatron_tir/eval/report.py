"""The evaluation report: one row per dataset and per data source, as the papers print them.

Per row (problems with n samples each, averaged over problems):

* ``avg@n`` -- mean reward of all n samples (SimpleTIR / ZeroTIR report avg@32).
* ``pass@k`` for k = 1, 2, 4, ... and n -- the unbiased estimator
  1 - C(n-c, k) / C(n, k) from all n samples (:func:`megatron_tir.eval.metrics.pass_at_k`);
  pass@1 equals avg@n.
* ``maj@k`` for the same k -- majority vote over the *first* k samples' final answers
  (:func:`majority_correct`): the answer given most often wins, samples without an answer
  do not vote, and a tie goes to the tied answer that appears first in sample order; the
  problem counts as solved when a sample with the winning answer was rewarded. Answers
  are compared as strings (stripped), so "1/2" and "0.5" are two votes.
* ``turns`` (mean model turns), ``code_use`` (SimpleTIR ``code_use_ratio``), ``void`` (share
  of trajectories with a void turn, SimpleTIR ``void_turn_ratio``), and the reasoning
  patterns of the correct trajectories where :mod:`megatron_tir.observe.diagnostics`
  provides them; the JSON holds every metric of :mod:`megatron_tir.eval.metrics`.

Rows: one per dataset (all its problems), then one per ``data_source`` inside a dataset
that holds more than one.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from megatron_tir.eval.metrics import compute_metrics, pass_at_k
from megatron_tir.rollout.batch import Group

PATTERNS = ("error_correction", "progressive_reasoning", "cross_checking")


def report_ks(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself."""
    if n < 1:
        raise ValueError(f"need n >= 1, got {n}")
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def majority_correct(answers: Sequence[str | None], rewards: Sequence[float], k: int) -> float:
    """1.0 when the majority answer of the first k samples is a rewarded one (ties: first seen)."""
    if not 1 <= k <= len(answers) or len(answers) != len(rewards):
        raise ValueError(f"need 1 <= k <= {len(answers)} and one reward per answer")
    votes: Counter[str] = Counter()
    first: dict[str, int] = {}
    for i, answer in enumerate(answers[:k]):
        if answer is None or not str(answer).strip():
            continue
        key = str(answer).strip()
        votes[key] += 1
        first.setdefault(key, i)
    if not votes:
        return 0.0
    top = max(votes.values())
    winner = min((key for key, v in votes.items() if v == top), key=first.__getitem__)
    return float(any(rewards[i] > 0 for i, a in enumerate(answers[:k])
                     if a is not None and str(a).strip() == winner))


def report_row(dataset: str, data_source: str, groups: Sequence[Group]) -> dict:
    """The row of the module docstring for ``groups`` (every group holds the same number n of samples)."""
    sizes = {len(g.trajectories) for g in groups}
    if len(sizes) != 1:
        raise ValueError(f"{dataset}: groups hold different numbers of samples {sorted(sizes)}")
    n = sizes.pop()
    ks = report_ks(n)
    metrics = compute_metrics(groups, n)
    passes = {k: 0.0 for k in ks}
    majs = {k: 0.0 for k in ks}
    for g in groups:
        rewards = g.rewards
        answers = [t.final_answer for t in g.trajectories]
        c = sum(r > 0 for r in rewards)
        for k in ks:
            passes[k] += pass_at_k(n, c, k)
            majs[k] += majority_correct(answers, rewards, k)
    d = metrics.diagnostics
    return {
        "dataset": dataset, "data_source": data_source, "problems": len(groups), "n": n,
        "avg_at_n": metrics.avg_at_k,
        "pass_at": {str(k): v / len(groups) for k, v in passes.items()},
        "maj_at": {str(k): v / len(groups) for k, v in majs.items()},
        "num_turns": metrics.tir["num_turns"], "code_use_ratio": metrics.tir["code_use_ratio"],
        "void_turn_ratio": metrics.tir["void_turn_ratio"],
        "patterns": {p: d[f"pattern_{p}"] for p in PATTERNS if f"pattern_{p}" in d},
        "tir": metrics.tir, "diagnostics": metrics.diagnostics, "status_counts": metrics.status_counts,
    }


def report_rows(datasets: Sequence[tuple[str, Sequence[Group]]]) -> list[dict]:
    """Rows for ``(dataset name, its groups)`` pairs: per dataset, then per data source within it."""
    rows = []
    for name, groups in datasets:
        rows.append(report_row(name, "*", groups))
        by_source: dict[str, list[Group]] = {}
        for g in groups:
            by_source.setdefault(g.problem.data_source if g.problem else "", []).append(g)
        if len(by_source) > 1:
            rows.extend(report_row(name, source or "(none)", gs) for source, gs in sorted(by_source.items()))
    return rows


TABLE_KEY = ("source: * = every data source of the dataset, then one row per source; avg@n: mean reward of the n "
             "samples; pass@k / maj@k: a correct answer among k samples / the majority answer of k is correct "
             "(unbiased over n); turns: mean turns; code_use: turns with a code block; void: void turns")
METRICS_KEY = ("finish_ratio: trajectories the model ended itself (a final answer or a void turn), not the turn or "
               "token budget or the infrastructure; completed_ratio: trajectories that ended with a final answer")


def format_table(rows: Sequence[dict]) -> str:
    """One plain-text table of the rows (percentages; n/a where undefined)."""
    if not rows:
        return "(no rows)"
    ks = report_ks(max(r["n"] for r in rows))
    pct = lambda x: "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}"  # noqa: E731
    patterns = [p for p in PATTERNS if any(p in r["patterns"] for r in rows)]
    head = (["dataset", "source", "problems", "n", "avg@n"] + [f"pass@{k}" for k in ks] + [f"maj@{k}" for k in ks]
            + ["turns", "code_use", "void"] + patterns)
    body = []
    for r in rows:
        body.append([r["dataset"], r["data_source"], str(r["problems"]), str(r["n"]), pct(r["avg_at_n"])]
                    + [pct(r["pass_at"].get(str(k))) for k in ks] + [pct(r["maj_at"].get(str(k))) for k in ks]
                    + [f"{r['num_turns']:.2f}", pct(r["code_use_ratio"]), pct(r["void_turn_ratio"])]
                    + [pct(r["patterns"].get(p)) for p in patterns])
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.rjust(w) if i > 1 else c.ljust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(head), line(["-" * w for w in widths]), *(line(b) for b in body)])

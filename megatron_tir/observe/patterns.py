"""Reasoning patterns of correct trajectories, from the trajectory's own structure (no LLM judge).

SimpleTIR (arXiv 2509.02479, Table 3) counts these patterns with Claude-3.7 as a judge; here
each is a rule over the recorded turns, code and tool results, applied to *correct*
trajectories only. The rate of a pattern is the share of correct trajectories that show it
(NaN when nothing is correct).

* **error correction** (``pattern_error_correction``) -- an execution failed (status other
  than ``ok``, or a non-empty stderr; infrastructure failures do not count) and a later
  execution succeeded (status ``ok`` and an empty stderr).
* **progressive reasoning** (``pattern_progressive_reasoning``) -- at least two code turns,
  and a later block builds on an earlier one: it reads a name that an earlier block bound
  (assignment, ``def``, ``class``, ``import``, loop or ``with`` target), or it contains a
  number that an earlier execution printed (numbers of at least two characters, so that
  ``0``, ``1``, ``2`` of ordinary code do not count).
* **cross-checking** (``pattern_cross_checking``) -- code ran after an answer had already
  been reached (a code turn whose prose, before the block, already holds a ``\\boxed{}``
  answer, or a code turn after one whose execution printed the final answer through
  ``final_answer``), or two successful executions printed the final answer.
"""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Sequence

from megatron_tir.rollout.trajectory import Trajectory, Turn
from megatron_tir.tir.markup import TurnKind
from sandbox_cluster.protocol import Status

PATTERNS = ("error_correction", "progressive_reasoning", "cross_checking")
_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?![\w.])")


def _executions(t: Trajectory) -> list[Turn]:
    return [x for x in t.turns if x.kind is TurnKind.CODE and x.tool is not None and not x.tool.infra_failure]


def _succeeded(turn: Turn) -> bool:
    r = turn.tool.result
    return r.status is Status.OK and not r.stderr.strip()


def error_correction(t: Trajectory) -> bool:
    seen_failure = False
    for x in _executions(t):
        if _succeeded(x):
            if seen_failure:
                return True
        else:
            seen_failure = True
    return False


def _bound_and_read(code: str) -> tuple[set[str], set[str]]:
    """Names a block binds and names it reads (empty sets when it does not parse)."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return set(), set()
    bound, read = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (bound if isinstance(node.ctx, (ast.Store, ast.Del)) else read).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
    return bound, read


def _numbers(text: str) -> set[str]:
    return {m for m in _NUMBER.findall(text) if len(m.lstrip("-")) >= 2}


def progressive_reasoning(t: Trajectory) -> bool:
    code_turns = [x for x in t.turns if x.kind is TurnKind.CODE and x.code is not None]
    if len(code_turns) < 2:
        return False
    bound: set[str] = set()
    printed: set[str] = set()
    for i, x in enumerate(code_turns):
        b, r = _bound_and_read(x.code)
        if i and ((r & bound) or (_numbers(x.code) & printed)):
            return True
        bound |= b
        if x.tool is not None:
            printed |= _numbers(x.tool.result.stdout)
    return False


def _mentions(stdout: str, answer: str) -> bool:
    answer = answer.strip()
    if not answer:
        return False
    return re.search(rf"(?<![\w.]){re.escape(answer)}(?![\w.])", stdout) is not None


def cross_checking(t: Trajectory) -> bool:
    answered = False
    for x in t.turns:
        if x.kind is TurnKind.CODE:
            prose = x.text.split("```", 1)[0]
            if answered or "\\boxed{" in prose:
                return True
            if x.tool is not None and x.tool.answer is not None:
                answered = True
        elif x.answer is not None:
            answered = True
    if t.final_answer is None:
        return False
    agreeing = [x for x in _executions(t) if _succeeded(x) and _mentions(x.tool.result.stdout, t.final_answer)]
    return len(agreeing) >= 2


DETECTORS = {"error_correction": error_correction, "progressive_reasoning": progressive_reasoning,
             "cross_checking": cross_checking}


def patterns_of(t: Trajectory) -> dict[str, bool]:
    return {name: fn(t) for name, fn in DETECTORS.items()}


def pattern_rates(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """``pattern_<name>``: share of the correct trajectories showing the pattern (NaN without any)."""
    correct = [t for t in trajs if t.correct]
    out = {}
    for name, fn in DETECTORS.items():
        out[f"pattern_{name}"] = sum(fn(t) for t in correct) / len(correct) if correct else math.nan
    return out

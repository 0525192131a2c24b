"""ZeroTIR's curves (arXiv 2505.07773, Figures 2-4) under ZeroTIR's own definitions.

Read from its released code, ``yyht/openrlhf_async_pipline`` (the reward function
``env/math/math_reward_tir.py``, ``math_score``; per response, logged as the mean over the
batch's responses). ``response`` is the whole response text -- model text and the tool
output appended to it (:func:`response_text`).

* ``avg_repeat_score`` -- mean over responses of ``repeatness(response)``
  (``env/common/repeatness.py``): the sum of the longest-common-prefix array of the
  response's character suffix array, times ``2 / (n (n + 1))`` for ``n`` characters (0 for
  ``n <= 1``). It is the share of character positions covered by repeated substrings,
  weighted by length: ``"abcd"`` scores 0, ``"aaaa"`` 0.6.
* ``code_count`` -- mean over responses of the number of matches of
  ``r"```python\\n(.*?)```"`` (DOTALL) in the response (``env/math/extract_code.py``,
  ``code_pattern``).
* ``code_proportion`` -- share of responses for which ``has_code(response)`` holds
  (``env/common/code_pattern.py``: ``extract_code_deepseek`` finds a non-blank block: a piece
  of ``response.split("```python")`` that contains a closing ``` with non-blank text before
  it; the piece before the first ``` ```python ``` counts too unless the response starts with
  the fence -- ZeroTIR's quirk, kept). ZeroTIR logs it as ``code_rewards``.
* ``code_in_correct`` -- share of *all* responses that have code (as above) *and* are
  correct (ZeroTIR's ``code_correct``: ``code_rewards > 0 and answer_rewards > 0``, default 0,
  averaged over the batch). Not the share among correct responses: that is this project's
  ``correct_with_code`` (:mod:`megatron_tir.eval.metrics`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from megatron_tir.rollout.trajectory import Trajectory

CODE_PATTERN = re.compile(r"```python\n(.*?)```", re.DOTALL)


def response_text(t: Trajectory) -> str:
    """The response as text: each turn's model text followed by the feedback appended after it."""
    return "".join(turn.text + (turn.tool.feedback if turn.tool is not None else "") for turn in t.turns)


def _suffix_array(codes: np.ndarray) -> np.ndarray:
    """Suffix array by prefix doubling (numpy sorts; O(n log^2 n))."""
    n = len(codes)
    rank = np.unique(codes, return_inverse=True)[1].astype(np.int64)
    k = 1
    while True:
        second = np.full(n, -1, dtype=np.int64)
        second[:n - k] = rank[k:] if k < n else second[:0]
        order = np.lexsort((second, rank))
        pairs = np.stack([rank[order], second[order]], axis=1)
        new = np.empty(n, dtype=np.int64)
        new[order] = np.concatenate([[0], np.cumsum(np.any(pairs[1:] != pairs[:-1], axis=1))])
        rank = new
        if rank.max() == n - 1 or k >= n:
            return order if rank.max() == n - 1 else np.argsort(rank, kind="stable")
        k <<= 1


def repeat_score(text: str) -> float:
    """ZeroTIR's ``repeatness``: sum of the LCP array (Kasai) over ``n (n + 1) / 2``."""
    n = len(text)
    if n <= 1:
        return 0.0
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    sa = _suffix_array(codes)
    inv = np.empty(n, dtype=np.int64)
    inv[sa] = np.arange(n)
    s = codes.tolist()
    sa_l, inv_l = sa.tolist(), inv.tolist()
    total, h = 0, 0
    for i in range(n):
        r = inv_l[i]
        if r == n - 1:
            h = 0
            continue
        j = sa_l[r + 1]
        while i + h < n and j + h < n and s[i + h] == s[j + h]:
            h += 1
        total += h
        if h:
            h -= 1
    return total * 2 / (n * (n + 1))


def has_code(text: str) -> bool:
    """ZeroTIR's ``has_code`` (``extract_code_deepseek`` returns a non-empty string)."""
    if text.startswith("```python"):
        text = "hey\n" + text
    return any(piece.split("```", 1)[0].strip() for piece in text.split("```python") if "```" in piece)


def code_count(text: str) -> int:
    return len(CODE_PATTERN.findall(text))


def zerotir_metrics(trajs: Sequence[Trajectory]) -> dict[str, float]:
    if not trajs:
        return {}
    texts = [response_text(t) for t in trajs]
    coded = [has_code(x) for x in texts]
    n = len(trajs)
    return {
        "avg_repeat_score": sum(repeat_score(x) for x in texts) / n,
        "code_count": sum(code_count(x) for x in texts) / n,
        "code_proportion": sum(coded) / n,
        "code_in_correct": sum(c and t.correct for c, t in zip(coded, trajs)) / n,
    }

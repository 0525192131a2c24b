"""Render dumped trajectories for a terminal: turns, code, tool output, feedback, status, reward.

Every line of text is prefixed by what the loss did with it: ``  │ `` for tokens the policy
update trained on (loss mask 1) and ``  ░ `` for masked ones -- the tool feedback always,
and every token of a row the update dropped (its header says why). On a terminal the masked
lines are also dimmed; written to a file or a pipe the output is plain text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

TRAINED, MASKED = "  │ ", "  ░ "
_DIM, _BOLD, _RESET = "\x1b[2m", "\x1b[1m", "\x1b[0m"


def _is_correct(r: dict) -> bool:
    return (r.get("reward") or 0) > 0


def _in_loss(r: dict) -> bool:
    return bool((r.get("update") or {}).get("in_loss"))


FILTERS: dict[str, Callable[[dict], bool]] = {
    "void": lambda r: r.get("status") == "void",
    "correct": _is_correct,
    "wrong": lambda r: not _is_correct(r),
    "in_loss": _in_loss,
    "dropped": lambda r: r.get("split") == "train" and not _in_loss(r),
    "code": lambda r: any(t.get("kind") == "code" for t in r.get("turns", ())),
    "train": lambda r: r.get("split") == "train",
    "eval": lambda r: r.get("split") == "eval",
    **{s: (lambda r, s=s: r.get("status") == s)
       for s in ("completed", "truncated", "max_turns", "tool_failed", "aborted")},
}


def parse_filters(text: str | None) -> list[Callable[[dict], bool]]:
    """``"void,train"`` -> predicates (all must hold); ValueError names an unknown one."""
    if not text:
        return []
    out = []
    for name in (x.strip() for x in text.split(",") if x.strip()):
        if name not in FILTERS:
            raise ValueError(f"unknown filter {name!r} (filters: {', '.join(FILTERS)})")
        out.append(FILTERS[name])
    return out


def select(records: Sequence[dict], filters: Sequence[Callable[[dict], bool]]) -> list[dict]:
    return [r for r in records if all(f(r) for f in filters)]


def _lines(text: str, prefix: str, color: bool) -> list[str]:
    rows = (text.rstrip("\n") or "(empty)").split("\n")
    if color and prefix == MASKED:
        return [f"{_DIM}{prefix}{x}{_RESET}" for x in rows]
    return [prefix + x for x in rows]


def render(rec: dict, *, color: bool = False, max_question_chars: int = 400) -> str:
    """One trajectory as text (see the module docstring)."""
    upd = rec.get("update")
    trained = upd is None or bool(upd.get("in_loss"))  # held-out rows: the model's text in plain style
    head = [f"step {rec['step']}"] if "step" in rec else []  # an `eval --out` record has no step or split
    head += [rec["split"]] if rec.get("split") else []
    head += [f"group {rec['group_id']} sample {rec['sample_index']}", f"status {rec.get('status')}",
             f"reward {rec.get('reward')}"]
    if upd is not None:
        if upd.get("in_loss"):
            adv = upd.get("advantage")
            head.append("in loss" + ("" if adv is None else f", advantage {adv:+.3f}"))  # None: per-token (GAE)
        else:
            head.append(f"NOT IN LOSS ({upd.get('dropped_by')})")
    if rec.get("void_reason"):
        head.append(f"void: {rec['void_reason']}")
    title = "== " + " · ".join(head)
    out = [f"{_BOLD}{title}{_RESET}" if color else title]
    question = rec.get("question")
    if question:
        q = question if len(question) <= max_question_chars else question[:max_question_chars] + " ..."
        out.append(f"question: {q}")
    out.append(f"ground truth: {rec.get('ground_truth')}   final answer: {rec.get('final_answer')}"
               f" ({rec.get('answer_source') or 'none'})")
    prefix = TRAINED if trained else MASKED
    for t in rec.get("turns", ()):
        out.append(f"[turn {t['index']} · {t['kind']} · {t['finish_reason']} · {t['model_tokens']} tokens · "
                   f"{t.get('reason', '')}]")
        out.extend(_lines(t.get("text", ""), prefix, color))
        tool = t.get("tool")
        if tool is not None:
            res = tool.get("result") or {}
            out.append(f"[tool · {res.get('status')} · {res.get('wall_time', 0.0):.2f} s · feedback masked, "
                       f"{t.get('feedback_tokens', 0)} tokens]")
            out.extend(_lines(tool.get("feedback", ""), MASKED, color))
        elif t.get("feedback_tokens"):
            out.append(f"[feedback · masked, {t['feedback_tokens']} tokens]")
    return "\n".join(out)


def parse_rendering(text: str) -> dict[str, list[str]]:
    """The inverse a test needs: ``{"trained": lines, "masked": lines, "headers": lines}`` of a plain rendering."""
    out = {"trained": [], "masked": [], "headers": []}
    for line in text.split("\n"):
        if line.startswith(TRAINED):
            out["trained"].append(line[len(TRAINED):])
        elif line.startswith(MASKED):
            out["masked"].append(line[len(MASKED):])
        elif line.startswith("== "):
            out["headers"].append(line[3:])
    return out

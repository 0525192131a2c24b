"""What a model turn contains: fenced code blocks, ``\\boxed{}`` answers, and the turn's kind.

This module is the single definition of the TIR text grammar. The rollout driver asks it
two questions about the text sampled so far in a turn: *which stop strings should the
engine use next* (:func:`stop_strings`) and *what is this turn* (:func:`classify_turn`).

Grammar (a small, strict subset of CommonMark fenced code blocks):

* Lines end at ``\\n``, ``\\r\\n`` or a lone ``\\r``.
* An **opening fence** is a line whose first characters are at most 3 spaces and then
  ```` ``` ````; the rest of the line is the info string, whose first word is the
  language (```` ```python title="a.py" ```` is Python). An info string containing a
  backtick makes the line ordinary text (inline code such as ```` ```x``` ````). A line
  that starts with ```` ``` ```` *inside* prose is an opening fence; one in the middle of
  a line is not.
* A block is **closed** by the first later line that starts with at most 3 spaces and
  ```` ``` ````; whatever follows on that line is not code. So ``print("```")`` does not
  close a block, but a line of a multi-line string that starts with ```` ``` ```` does.
  An opening fence indented by N spaces removes up to N spaces from each code line (so
  code inside a list item runs as written).
* A block is **executable** when its language is ``python``, ``py``, ``python3`` or
  empty (a bare fence). Other blocks (```` ```output ````, ```` ```latex ````) are text.
* A **final answer** in model text is the last ``\\boxed{...}`` with balanced braces
  outside executable blocks (``\\boxed`` inside code is a string in a program, not an
  answer; inside a ```` ```latex ```` or ```` ```output ```` block it is text like any other).

A turn is ``"code"`` when it contains a closed executable block (the driver stops the
engine right there), else ``"answer"`` when its prose has a complete ``\\boxed{}``, else
``"void"`` -- the SimpleTIR rule: neither a complete code block nor a final answer.
A turn the engine aborted before any code or answer is ``"aborted"``: an infrastructure
outcome, never void. A code turn whose prose also holds a final answer is ``final``: the
driver runs the code, appends its feedback and ends the trajectory (as SimpleTIR's code
does), since an answer given is the model's declaration that it is done.

Stop strings and their cost
---------------------------
Engines (SGLang included) match stop strings anywhere in the generated text, so the stop
string ```` ``` ```` would fire on the opening fence as well as on the closing one. The
driver therefore generates a turn in *phases* and picks the stop strings from the state
of the text so far:

* outside a block, or inside a block at the start of a line: ``("```",)`` -- this pauses
  on every opening fence;
* inside a block, mid-line: ``"\\n```"``, ``"\\n ```"``, ``"\\n  ```"``, ``"\\n   ```"`` and the
  same after ``"\\r"`` -- a closing fence can only start a line, and ``print("```")``
  does not pause the engine.

After each phase the parser (not the engine) decides whether the turn is over. A pause
that was not a turn end (an opening fence, a ``"```"`` inside code at a line start, a
closed non-Python block) simply continues with a new request that extends the same
token ids, so every kept token is a sampled token and no sampled token is dropped: each
event that ends a turn contains one of the active stop strings in the text of the phase
that produced it. The cost is one extra engine request per code block (two when the
opening fence is followed by ```` ``` ```` at a line start inside code); SGLang's radix
cache makes the extra prefill nearly free, the CPU engine re-reads its prompt.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

FENCE = "```"
EXECUTABLE_LANGS = frozenset({"python", "py", "python3", ""})
MAX_FENCE_INDENT = 3

# Stop strings the engine gets (see module docstring).
STOPS_ANY_FENCE: tuple[str, ...] = (FENCE,)
STOPS_CLOSING_FENCE: tuple[str, ...] = tuple(eol + " " * k + FENCE for eol in ("\n", "\r")
                                             for k in range(MAX_FENCE_INDENT + 1))


class TurnKind(str, enum.Enum):
    CODE = "code"  # a complete tool call (the python tool: an executable code block): run it, append its feedback
    ANSWER = "answer"  # no complete code block, a final \boxed{} answer in prose
    VOID = "void"  # neither: the trajectory stops and is excluded from the policy loss
    ABORTED = "aborted"  # the engine aborted the turn before any code or answer: not the model's doing, never void


@dataclass(kw_only=True, slots=True, frozen=True)
class CodeBlock:
    lang: str  # language tag, lower-cased ("" for a bare fence)
    code: str  # the lines between the fences ("" while the opening line is unfinished)
    start: int  # offset of the opening fence's backticks in the text
    end: int | None  # offset just past the closing fence's backticks; None while open

    @property
    def closed(self) -> bool:
        return self.end is not None

    @property
    def executable(self) -> bool:
        return self.lang in EXECUTABLE_LANGS


@dataclass(kw_only=True, slots=True, frozen=True)
class Markup:
    """The parse of one turn's text."""

    blocks: tuple[CodeBlock, ...]
    prose: str  # the text outside executable blocks (fences and non-Python blocks included): answers count here

    @property
    def open_block(self) -> CodeBlock | None:
        """The block still open at the end of the text, if any."""
        return self.blocks[-1] if self.blocks and not self.blocks[-1].closed else None

    @property
    def first_executable(self) -> CodeBlock | None:
        """The first closed executable block: the one that ends the turn."""
        for b in self.blocks:
            if b.closed and b.executable:
                return b
        return None


_EOL = re.compile(r"\r\n|\r|\n")  # CommonMark line endings


def _lines(text: str) -> list[tuple[int, int, bool]]:
    """``(start, end, terminated)`` of each line; ``end`` excludes the line ending."""
    out: list[tuple[int, int, bool]] = []
    pos = 0
    while pos < len(text):
        m = _EOL.search(text, pos)
        if m is None:
            out.append((pos, len(text), False))
            break
        out.append((pos, m.start(), True))
        pos = m.end()
    return out


def _fence_at(text: str, start: int, end: int) -> int | None:
    """Offset of ``` if the line [start, end) starts with <= 3 spaces and a fence."""
    i = start
    while i < end and i - start < MAX_FENCE_INDENT and text[i] == " ":
        i += 1
    return i if text.startswith(FENCE, i) and i + len(FENCE) <= end else None


def _dedent(line: str, indent: int) -> str:
    """``line`` without up to ``indent`` leading spaces (CommonMark, indented fences)."""
    k = 0
    while k < indent and k < len(line) and line[k] == " ":
        k += 1
    return line[k:]


def parse(text: str) -> Markup:
    """Split ``text`` into fenced blocks and prose, following the module's grammar."""
    blocks: list[CodeBlock] = []
    prose: list[str] = []
    prose_from = 0
    lines = _lines(text)
    i = 0
    while i < len(lines):
        start, end, terminated = lines[i]
        fence_at = _fence_at(text, start, end)
        info = text[fence_at + len(FENCE):end] if fence_at is not None else ""
        if fence_at is None or "`" in info:
            i += 1
            continue
        # An opening fence; the language is the info string's first word.
        words = info.split()
        lang = words[0].lower() if words else ""
        executable = lang in EXECUTABLE_LANGS
        if executable:  # prose stops before the code
            prose.append(text[prose_from:end])
        if not terminated:  # the opening line is not finished yet: a block with no body so far
            blocks.append(CodeBlock(lang=lang, code="", start=fence_at, end=None))
            prose_from = len(text) if executable else prose_from
            break
        j = i + 1
        close_at = None
        while j < len(lines):
            close_at = _fence_at(text, lines[j][0], lines[j][1])
            if close_at is not None:
                break
            j += 1
        indent = fence_at - start
        code = "\n".join(_dedent(text[ls:le], indent) for ls, le, _ in lines[i + 1:j])
        if close_at is None:
            blocks.append(CodeBlock(lang=lang, code=code, start=fence_at, end=None))
            prose_from = len(text) if executable else prose_from
            break
        blocks.append(CodeBlock(lang=lang, code=code, start=fence_at, end=close_at + len(FENCE)))
        if executable:  # prose resumes at the closing fence; the rest of that line is not code
            prose_from = close_at
        i = j + 1
    prose.append(text[prose_from:])
    return Markup(blocks=tuple(blocks), prose="".join(prose))


def extract_code(text: str) -> str | None:
    """The code of the first complete executable block in ``text`` (None if there is none)."""
    block = parse(text).first_executable
    return None if block is None else block.code


def stop_strings(turn_text: str) -> tuple[str, ...]:
    """The stop strings for the next engine request, given the turn's text so far.

    Every event that can end the turn (a closing fence) must contain one of the returned
    strings *within the next request's own text*, since engines match stops there only.
    """
    line = turn_text[max(turn_text.rfind("\n"), turn_text.rfind("\r")) + 1:]
    stripped = line.lstrip(" ")
    if len(line) - len(stripped) <= MAX_FENCE_INDENT and len(stripped) < len(FENCE) and FENCE.startswith(stripped):
        # At a possible fence position (a line start, maybe a partial fence already
        # written): the rest of the fence, matched anywhere.
        return (FENCE[len(stripped):],)
    if parse(turn_text).open_block is None:
        return STOPS_ANY_FENCE  # prose: pause on every fence; opening ones start a line
    return STOPS_CLOSING_FENCE  # inside a block, mid-line: a fence must start a line


# ---------------------------------------------------------------------------- answers

_BOXED = re.compile(r"\\boxed\s*\{")


def find_boxed(text: str) -> list[str]:
    """Contents of every complete ``\\boxed{...}`` in ``text`` (balanced braces), in order.

    A backslash takes the next character with it: ``\\{`` and ``\\}`` (escaped braces, as
    in ``\\boxed{\\{1,2\\}}``) do not count as nesting, and ``\\\\`` (a LaTeX line
    break) does not escape the brace after it. A ``\\boxed{`` left unbalanced (cut by the
    length limit, or abandoned by the model) is skipped; complete ones after it count.
    """
    out: list[str] = []
    pos = 0
    while (m := _BOXED.search(text, pos)) is not None:
        depth = 1
        i = m.end()
        while i < len(text) and depth:
            ch = text[i]
            if ch == "\\":
                i += 2
                continue
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            i += 1
        if depth:
            pos = m.end()  # unbalanced: look for a complete one after its opening brace
            continue
        out.append(text[m.end():i - 1].strip())
        pos = i
    return out


def last_boxed(text: str) -> str | None:
    found = find_boxed(text)
    return found[-1] if found else None


def answer_in_model_text(text: str) -> str | None:
    """The final answer a model turn states: the last ``\\boxed{}`` outside code blocks."""
    return last_boxed(parse(text).prose)


# ----------------------------------------------------------------- turn classification

@dataclass(kw_only=True, slots=True, frozen=True)
class TurnClass:
    kind: TurnKind
    reason: str
    code: str | None = None  # for "code": the code to execute
    lang: str | None = None
    answer: str | None = None  # the last \boxed{} in the turn's prose, whatever the kind
    code_end: int | None = None  # for "code": offset just past the closing fence
    final: bool = False  # the turn gives a final answer: the trajectory ends after it (after its code runs)
    tool: str | None = None  # for "code": the name of the tool whose call the turn ends with

    @property
    def void(self) -> bool:
        return self.kind is TurnKind.VOID


def classify_turn(text: str, finish_reason: str | None = None, *, tools: bool = True) -> TurnClass:
    """Classify one model turn (its text only, no prompt or feedback).

    ``tools=False`` (text-only rollouts): code blocks are text; the turn is an answer or void.

    ``finish_reason`` is how generation of the turn ended (``"stop"``, ``"eos"``,
    ``"length"``, ``"abort"``, or a :class:`~megatron_tir.rollout.engines.base.FinishReason`);
    it only refines the reason text, never the kind, except that an aborted turn with no
    code or answer is ``aborted`` (an infrastructure outcome, never void).
    """
    fr = getattr(finish_reason, "value", finish_reason)
    if fr not in (None, "stop", "eos", "length", "abort"):
        raise ValueError(f"unknown finish_reason {finish_reason!r} (stop, eos, length, abort)")
    m = parse(text)
    answer = last_boxed(m.prose)
    block = m.first_executable if tools else None
    if block is not None:
        reason = "complete python code block" if block.lang else "complete code block (no language tag)"
        if not block.code.strip():
            reason = "complete but empty code block"
        if answer is not None:
            reason += " and a boxed final answer (the trajectory ends after the code runs)"
        return TurnClass(kind=TurnKind.CODE, reason=reason, code=block.code, lang=block.lang,
                         answer=answer, code_end=block.end, final=answer is not None)
    open_block = m.open_block
    tail = {"length": "length cut", "eos": "EOS", "stop": "stop", "abort": "engine abort", None: "end of text"}[fr]
    if answer is not None:
        reason = "boxed final answer"
        if open_block is not None:
            reason += f" (then an unclosed code block, {tail})"
        elif fr == "length":
            reason += " (then cut by the length limit)"
        return TurnClass(kind=TurnKind.ANSWER, reason=reason, answer=answer, final=True)
    if fr == "abort":
        return TurnClass(kind=TurnKind.ABORTED, reason="aborted by the engine")
    if not tools:
        return TurnClass(kind=TurnKind.VOID, reason=f"no final answer (text-only, {tail})")
    if open_block is not None:
        what = "code block" if open_block.executable else f"'{open_block.lang}' block"
        if fr == "length":
            reason = f"length cut inside a {what} (partial code)"
        elif fr == "eos":
            reason = f"EOS inside an unclosed {what} (partial code)"
        else:
            reason = f"unclosed {what} (partial code)"
        return TurnClass(kind=TurnKind.VOID, reason=reason)
    others = [b.lang for b in m.blocks if b.closed and not b.executable]
    extra = f" (only non-python blocks: {', '.join(repr(o) for o in others)})" if others else ""
    if fr == "length":
        return TurnClass(kind=TurnKind.VOID, reason=f"length cut without code or answer{extra}")
    if fr == "eos":
        return TurnClass(kind=TurnKind.VOID, reason=f"EOS without code or answer{extra}")
    return TurnClass(kind=TurnKind.VOID, reason=f"no complete code block and no final answer{extra}")
